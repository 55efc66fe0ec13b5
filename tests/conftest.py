"""Fixtures every test module gets: nothing written outside pytest's temporary folder, and the
thread count each test found given back after it. Shared helpers are in helpers.py."""

import os
import shutil
import tempfile

import pytest

import zoo
from zoo.core.native import threads_set_to

# Where zoo and the libraries the tests run would write outside a test's own folders: zoo's
# token cache (~/.cache/zoo), its crash files ($XDG_CACHE_HOME/zoo/crashes), matplotlib's and
# Hugging Face's caches, temporary files. The tests run with a read-only home (docs/testing.md).
_REDIRECTED = {"ZOO_CACHE": "zoo-cache", "XDG_CACHE_HOME": "cache", "XDG_CONFIG_HOME": "config",
               "MPLCONFIGDIR": "matplotlib", "HF_HOME": "huggingface", "TMPDIR": "tmp"}


@pytest.fixture(scope="session", autouse=True)
def writes_stay_in_pytests_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("env")  # short: Open MPI's sockets under TMPDIR have a path limit
    with pytest.MonkeyPatch.context() as mp:
        for var, name in _REDIRECTED.items():
            (root / name).mkdir()
            mp.setenv(var, str(root / name))
        mp.setattr(tempfile, "tempdir", str(root / "tmp"))
        yield root


@pytest.fixture(autouse=True)
def restore_threads():
    """A test (or the trainer it runs) may set the process's thread count: the next gets its own back."""
    with threads_set_to(zoo.get_threads()):
        yield


@pytest.fixture(scope="module", autouse=True)
def restore_threads_after_the_module():
    """Likewise a module's fixtures: test_distributed's reference runs train in this process at one
    thread, and every module after it ran at one thread instead of the machine's count."""
    with threads_set_to(zoo.get_threads()):
        yield


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Runs the test at 1 and at 2 OpenMP threads."""
    zoo.set_threads(request.param)
    return request.param


def pytest_configure(config):
    # A run meant to test the Clad build (make test-clad) must not pass by skipping it.
    if os.environ.get("ZOO_TEST_CLAD") == "1" and not zoo.build_info()["clad"]:
        raise pytest.UsageError("ZOO_TEST_CLAD=1, but this zoo was built without the Clad backend (docs/clad.md)")
    # PyTorch makes its compiler's cache folder as it is imported, while the test modules are
    # collected (before any fixture): a folder of the run's own, removed when it ends.
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        config._zoo_torch_cache = tempfile.mkdtemp(prefix="zoo-tests-torch-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = config._zoo_torch_cache


def pytest_unconfigure(config):
    if getattr(config, "_zoo_torch_cache", None):
        shutil.rmtree(config._zoo_torch_cache, ignore_errors=True)
