#!/bin/bash
# The suite on aarch64, from an x86-64 Debian machine (issue 30: the core builds and passes its
# tests on ARM, where there is no oneDNN). The core is cross-compiled by Debian's
# aarch64-linux-gnu-g++ through CMakeLists.txt as it stands (OpenBLAS from the aarch64
# scipy-openblas32 wheel), and the tests run on an arm64 Debian's Python under qemu-user, with
# the aarch64 wheels of zoo's runtime dependencies from PyPI. Emulated, so slow: minutes for a
# module, about an hour for the suite on one core (its PyTorch references skip: there is no
# PyTorch here).
#
#   make test-arm                          the whole suite
#   make test-arm ARGS="tests/test_gemm.py -x"
#
# Needs root: apt-get (the cross compiler, qemu-user, mmdebstrap) and binfmt_misc, through
# which the tests' own subprocesses (sys.executable) run the aarch64 Python. Everything else
# lies in build/arm/.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$root/build/arm
host_python=${PYTHON:-$root/.venv/bin/python}
mkdir -p "$work"

need=()
command -v aarch64-linux-gnu-g++ > /dev/null || need+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64 > /dev/null || need+=(qemu-user)
command -v mmdebstrap > /dev/null || need+=(mmdebstrap)
if ((${#need[@]})); then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"
fi

# An arm64 root of this machine's Debian release: its Python, headers and C++ runtime, unpacked
# (nothing runs in it but Python).
codename=$(. /etc/os-release && echo "$VERSION_CODENAME")
rootfs=$work/rootfs-$codename
if [ ! -x "$rootfs/usr/bin/python3" ]; then
    rm -rf "$rootfs"
    mmdebstrap --arch=arm64 --variant=extract --include=python3,libpython3-dev,libgomp1,libstdc++6 \
        "$codename" "$rootfs"
fi
export QEMU_LD_PREFIX=$rootfs

# Run an aarch64 ELF file as the kernel runs any program (not registered by qemu-user itself
# where systemd-binfmt does not run, as in containers).
binfmt=/proc/sys/fs/binfmt_misc
[ -e "$binfmt/register" ] || mount -t binfmt_misc binfmt_misc "$binfmt"
if [ ! -e "$binfmt/qemu-aarch64" ]; then
    magic='\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00'
    mask='\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff'
    echo ":qemu-aarch64:M::$magic:$mask:$(command -v qemu-aarch64):" > "$binfmt/register"
fi
py=$(readlink -f "$rootfs/usr/bin/python3")
pyver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')

# zoo's runtime dependencies (pyproject.toml) and pytest, as aarch64 wheels, unpacked into one
# folder on the emulated Python's path (pip cannot install into that Python).
site=$work/site-cp$pyver
if [ ! -e "$site/.complete" ]; then
    # (their markers evaluated for the target: pip would evaluate them for this machine)
    mapfile -t deps < <(cd "$root" && "$host_python" - "$pyver" << 'EOF'
import sys, tomllib
from packaging.requirements import Requirement
target = {"platform_machine": "aarch64", "python_version": f"{sys.argv[1][0]}.{sys.argv[1][1:]}"}
for line in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    r = Requirement(line)
    if r.marker is None or r.marker.evaluate(target):
        r.marker = None
        print(r)
EOF
    )
    rm -rf "$site" "$work/wheels"
    "$host_python" -m pip download -q --only-binary=:all: --python-version "$pyver" --implementation cp \
        --abi "cp$pyver" --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 \
        --platform manylinux_2_28_aarch64 -d "$work/wheels" "${deps[@]}" pytest safetensors
    for w in "$work"/wheels/*.whl; do
        "$host_python" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$w" "$site"
    done
    touch "$site/.complete"
fi

# The core, cross-compiled by CMakeLists.txt. CMake asks the emulated Python (and the
# scipy-openblas32 wheel in it) where things are; Debian keeps pyconfig.h under the target's
# triplet, which the cross compiler does not search.
cat > "$work/python" << EOF
#!/bin/sh
export QEMU_LD_PREFIX=$rootfs PYTHONPATH=$site\${ZOO_ARM_PATH:+:\$ZOO_ARM_PATH}
exec $py "\$@"
EOF
chmod +x "$work/python"
cat > "$work/toolchain.cmake" << EOF
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
EOF
mkdir -p "$work/include"
ln -sfn "$rootfs/usr/include/aarch64-linux-gnu" "$work/include/aarch64-linux-gnu"
pybind11_dir=$("$host_python" -c 'import pybind11; print(pybind11.get_cmake_dir())')
cmake -S "$root" -B "$work/core" -G Ninja -DCMAKE_TOOLCHAIN_FILE="$work/toolchain.cmake" \
    -DPython_EXECUTABLE="$work/python" -DPython_INCLUDE_DIR="$rootfs/usr/include/python${pyver:0:1}.${pyver:1}" \
    -DPython_SOABI="cpython-$pyver-aarch64-linux-gnu" -Dpybind11_DIR="$pybind11_dir" \
    -DCMAKE_CXX_FLAGS="-I$work/include" -DZOO_NATIVE_ARCH=OFF > "$work/cmake.log" || { cat "$work/cmake.log"; exit 1; }
cmake --build "$work/core" -j"$(nproc)"

# The package with the aarch64 extension; the repository's other files, to run from, beside a
# link to ../shared (the tests look for both beside the repository, and a test's subprocess
# started there must import this package, not the x86-64 one).
rm -rf "$work/pkg" "$work/run"
mkdir -p "$work/pkg" "$work/run"
(cd "$root" && git ls-files -z --cached --others --exclude-standard zoo | xargs -0 cp --parents -t "$work/pkg")
cp "$work"/core/_native.cpython-*-aarch64-linux-gnu.so "$work/pkg/zoo/core/"
(cd "$root" && git ls-files -z --cached --others --exclude-standard | grep -zv '^zoo/' | xargs -0 cp --parents -t "$work/run")
if [ -e "$root/../shared" ]; then ln -sfn "$(readlink -f "$root/../shared")" "$work/shared"; fi
cd "$work/run"
# The whole suite leaves out what emulation alone breaks: training runs that take seconds
# natively exceed their hang timeouts here, and qemu-user ignores madvise, so the mapped
# embedding's MADV_RANDOM does not stop fault-around (16 pages per row read).
emulation_breaks=(
    tests/test_instruct.py::test_an_instruction_finetune_answers_held_out_questions
    tests/test_lora.py::test_a_run_that_cannot_fit_is_refused_up_front_with_what_would
    tests/test_lora.py::test_lora_on_a_quantized_base_lowers_the_loss
    tests/test_mapped_embedding.py::test_only_the_rows_a_pass_reads_are_resident
)
if [ -n "${ARGS:-}" ]; then
    args=($ARGS)
else
    args=(tests "${emulation_breaks[@]/#/--deselect=}")
fi
ZOO_ARM_PATH=$work/pkg exec "$work/python" -m pytest -q -p no:cacheprovider "${args[@]}"
