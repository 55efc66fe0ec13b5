#!/bin/bash
# The MLP activations' loops as each GCC of Debian trixie (12, 13, 14) builds them (issue 30: a
# GCC 13 build ran GPT-2's GELU 8x slower on an AMX machine than a GCC 12 one on another; users
# build zoo with whatever GCC their distribution has). Each compiler builds the extension from this checkout's
# tracked files, for each TARGET, through CMakeLists.txt, and zoo.tools.bench_activations times
# each build, all inside a trixie tree made by mmdebstrap, with this checkout's Python and
# packages mounted at their own paths. Prints one table of all builds at the end.
#
#   tools/compiler_check.sh [TARGET...]
#   tools/compiler_check.sh --run COMMAND...   COMMAND in the checkout, inside the tree, e.g. to
#                                              compare two of the builds' steps:
#       tools/compiler_check.sh --run python -m zoo.tools.bench_ab --base build/compilers/g++-13-native \
#           --current build/compilers/g++-12-native --preset gpt2 --precision bf16
#
# TARGET: native (the default: this CPU, -march=native) or a GCC -march name, e.g.
# "native sapphirerapids". A named target is built without AMX and AVX512-FP16 (-mno-...), which
# the loops do not use and most CPUs lack; a target needing instructions this CPU lacks fails.
# Needs root and mmdebstrap. Everything lies in build/compilers/ (the tree, about 730 MB, is made
# once).
set -euo pipefail
# The bind mounts below live in a mount namespace of this script's own, so they end with it,
# however it ends: the tree lies inside the checkout, which is mounted inside the tree.
[ -n "${ZOO_COMPILER_CHECK_NS:-}" ] || exec env ZOO_COMPILER_CHECK_NS=1 unshare --mount --propagation private "$0" "$@"
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$repo/build/compilers
python=${PYTHON:-$repo/.venv/bin/python}
targets=("$@")
((${#targets[@]})) || targets=(native)
compilers=(g++-12 g++-13 g++-14)
mkdir -p "$work"

command -v mmdebstrap > /dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q mmdebstrap; }
rootfs=$work/rootfs-trixie
if [ ! -e "$rootfs/.complete" ]; then
    rm -rf "$rootfs"
    # the compilers, and the shared libraries this machine's Python loads (ctypes: libffi)
    mmdebstrap --variant=minbase --include="$(IFS=,; echo "${compilers[*]}"),libffi8,zlib1g,libbz2-1.0,liblzma5" \
        trixie "$rootfs"
    touch "$rootfs/.complete"
fi

# This checkout, its Python and its packages, at the same paths inside the tree.
prefix=$("$python" -c 'import sys; print(sys.prefix)')
base_prefix=$("$python" -c 'import sys; print(sys.base_prefix)')
site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
bind() {  # bind DIR: DIR at the same path inside the tree
    mountpoint -q "$rootfs$1" && return
    mkdir -p "$rootfs$1"
    mount --bind "$1" "$rootfs$1"
}
bind "$repo"
for d in "$base_prefix" "$prefix"; do
    case "$d/" in "$repo"/*) ;; *) bind "$d" ;; esac
done
for d in /proc /dev; do bind "$d"; done
in_tree() { chroot "$rootfs" env PATH="$(dirname "$python"):/usr/bin:/bin" "$@"; }
if [ "${1:-}" = --run ]; then
    shift
    cd "$repo"
    in_tree bash -c 'cd "$1" && shift && "$@"' - "$repo" "$@"
    exit
fi

# The tracked files, once per build: each build's extension lies in its own zoo/core/.
src=$work/src
rm -rf "$src"
mkdir -p "$src"
git -C "$repo" ls-files -z | (cd "$repo" && xargs -0 cp --parents -t "$src")
pybind11_dir=$("$python" -m pybind11 --cmakedir)
names=()
for cxx in "${compilers[@]}"; do
    for target in "${targets[@]}"; do
        name=$cxx-$target
        tree=$work/$name
        rm -rf "$tree"
        cp -r "$src" "$tree"
        if [ "$target" = native ]; then
            arch=(-DZOO_NATIVE_ARCH=ON)
        else
            arch=(-DZOO_NATIVE_ARCH=OFF
                  "-DZOO_ARCH_FLAGS=-march=$target;-mno-amx-tile;-mno-amx-bf16;-mno-amx-int8;-mno-avx512fp16")
        fi
        echo "== $name: building ($(date -u +%H:%M:%S))"
        if ! in_tree cmake -S "$tree" -B "$tree/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER="$cxx" \
            -DPython_EXECUTABLE="$python" -Dpybind11_DIR="$pybind11_dir" "${arch[@]}" > "$tree/build.log" 2>&1 ||
            ! in_tree cmake --build "$tree/build" >> "$tree/build.log" 2>&1; then
            echo "== $name: the build failed ($tree/build.log):"
            tail -n 15 "$tree/build.log"
            continue
        fi
        cp "$tree"/build/_native*.so "$tree/zoo/core/"
        # -S: the tree's zoo, not the one the environment's .pth files install
        if in_tree "$python" -S -c 'import runpy, sys; sys.path[:0] = sys.argv[1:3]
sys.argv = ["bench_activations"] + sys.argv[3:]
runpy.run_module("zoo.tools.bench_activations", run_name="__main__")' "$tree" "$site" --json "$work/$name.json"; then
            names+=("$name")
        else
            echo "== $name: bench_activations failed"
        fi
    done
done

echo "== all builds, forward / pullback ms (best of 7)"
"$python" - "$work" "${names[@]}" << 'EOF'
import json, sys
from pathlib import Path
work, names = Path(sys.argv[1]), sys.argv[2:]
runs = {n: json.loads((work / f"{n}.json").read_text()) for n in names}
acts = list(next(iter(runs.values()))["activations"]) if runs else []
print("| build | compiler |", " | ".join(acts), "|")
print("|---|---|" + "---|" * len(acts))
for n, r in runs.items():
    cells = []
    for a in acts:
        t = r["activations"][a]
        cells.append(f"{t['forward_ms']:.1f} / " + (f"{t['pullback_ms']:.1f}" if t["pullback_ms"] is not None else "-"))
    print(f"| {n} | {r['compiler']} |", " | ".join(cells), "|")
EOF
