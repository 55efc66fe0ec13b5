# The two commands a fresh clone needs:
#   make demo   set up, then train a tiny model from scratch on the embedded text
#   make test   set up with the test extras, then run the whole suite
VENV ?= .venv
PY := $(VENV)/bin/python
NATIVE := $(wildcard native/*/*.hpp native/*/*.cpp) CMakeLists.txt pyproject.toml

.PHONY: demo test test-clad test-arm setup setup-dev clean

demo: $(VENV)/.installed
	$(VENV)/bin/zoo train

# Two pytest-xdist workers, each taking whole modules (a module's fixtures stay shared): the suite
# is mostly one core's work (imports of PyTorch, the benchmarks' worker processes), and on 2 cores
# it took 5 min 17 s with two workers, 9 min 10 s in one process (docs/testing.md). TEST_WORKERS=N: N.
TEST_WORKERS ?= 2
PYTEST := $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile

test: $(VENV)/.installed-dev
	$(PYTEST) tests

# The suite on a Clad build (docs/clad.md): Clad's build folder, the whole suite (the tests that
# need Clad run, ZOO_TEST_CLAD=1 fails the run if the build has no Clad), then the default build back.
CLAD_DIR ?= /opt/clad
CLAD_CXX ?= /usr/lib/llvm-19/bin/clang++
test-clad: $(VENV)/.installed-dev
	ZOO_CLAD_DIR=$(CLAD_DIR) CXX=$(CLAD_CXX) $(PY) -m pip install -q --no-build-isolation -e .
	ZOO_TEST_CLAD=1 $(PYTEST) tests; status=$$?; \
	    $(PY) -m pip install -q --no-build-isolation -e . && exit $$status

# The suite on aarch64 without oneDNN, emulated on an x86-64 Debian machine (tools/test_arm.sh:
# root; about an hour on one core). ARGS: pytest's arguments instead of the whole suite.
test-arm: $(VENV)/.installed
	ARGS="$(ARGS)" PYTHON=$(PY) tools/test_arm.sh

setup: $(VENV)/.installed
setup-dev: $(VENV)/.installed-dev

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# The native core is built once here (no build isolation, so rebuilds reuse these tools).
$(VENV)/.installed: $(VENV)/bin/python $(NATIVE)
	$(PY) -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" "scipy-openblas32>=0.3.27" ninja cmake \
	    "onednn-cpu-gomp>=2023.2; platform_machine == 'x86_64'" "onednn-devel-cpu-gomp>=2023.2; platform_machine == 'x86_64'"
	$(PY) -m pip install -q --no-build-isolation -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q --no-build-isolation -e ".[dev]"
	touch $@

clean:
	rm -rf build $(VENV)
