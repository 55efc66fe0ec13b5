#!/bin/bash
# Builds tools/onednn_layouts.cpp against the oneDNN that zoo links (the onednn-devel-cpu-gomp
# wheel in .venv, make setup) and runs it on 2 threads: each product of a LoRA step's linear
# layers and LM head, with the weights as zoo stores them (timed whole, and as zoo runs them) and
# prepacked by oneDNN (docs/benchmarks.md).
#
#   tools/onednn_layouts.sh [ROWS D_MODEL QKV_OUT D_FF [VOCAB HEAD_ROWS] [JSON]]
#   default: llama-3.2-1b at 256 rows, its LM head in chunks of 128 rows
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
[ -f "$venv/include/oneapi/dnnl/dnnl.hpp" ] || { echo "onednn_layouts: no oneDNN headers in $venv/include (make setup on x86_64)" >&2; exit 1; }
mkdir -p build
lib=$(cd "$venv/lib" && pwd)
${CXX:-g++} -O2 -std=c++17 -fopenmp tools/onednn_layouts.cpp -I"$venv/include" -L"$lib" -ldnnl -Wl,-rpath,"$lib" \
    -o build/onednn_layouts
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} build/onednn_layouts "$@"
