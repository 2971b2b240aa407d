#!/usr/bin/env bash
# The GPU benchmarks as one prepared run, for a lent NVIDIA machine (about 10 minutes on one H200):
#
#   bench/gpu.sh [--budget-s 560] [--dry-run]
#
# 1. builds the patched and the unpatched llama-server with CUDA (scripts/build_llama.sh --cuda,
#    cached like every build; ccache makes the second build a relink of the patched files),
# 2. writes the 'gpu' random-weight model (0.85 B parameters, F32, controller/testmodels.py),
# 3. runs the pressure benchmark (8192 band, equal-long and mixed, every mode) and the cost
#    benchmark (patched vs unpatched and the whole stack, 20 pairs) with every layer on the GPU,
#    writing bench/results/gpu-pressure.md|png and bench/results/gpu-overhead.md.
# Each stage gets what is left of the budget; a stage that runs out is stopped and the script
# says which. The machine has no network: set KVCTL_LLAMA_SDIST to a copied sdist and have the
# Python dependencies installed (a carried .venv, or pip install --no-index --find-links WHEELS).
# KVCTL_CUDA_ARCH (default: native) picks the CUDA architectures.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

budget=560
dry=0
while [ $# -gt 0 ]; do
    case "$1" in
        --budget-s) budget="$2"; shift ;;
        --dry-run) dry=1 ;;
        -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu.sh: unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done

py="${KVCTL_PYTHON:-python3}"
[ -x .venv/bin/python ] && py=.venv/bin/python
export KVCTL_BENCH_BUILD_ARGS="--cuda --cuda-arch ${KVCTL_CUDA_ARCH:-native}"
# FlashAttention kernels are most of a CUDA build's time; both servers are built alike
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_CUDA_FA=OFF}"
start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }

stage() {  # stage NAME COMMAND...: run with what is left of the budget
    local name="$1"; shift
    local t; t="$(left)"
    if [ "$dry" = 1 ]; then echo "[dry-run] $name: $*"; return 0; fi
    if [ "$t" -le 10 ]; then echo "gpu.sh: no time left for $name" >&2; return 1; fi
    echo "== $name ($t s left)"
    if ! timeout "$t" "$@"; then echo "gpu.sh: $name failed or ran out of time" >&2; return 1; fi
}

if [ "$dry" = 0 ]; then
    command -v nvidia-smi >/dev/null 2>&1 || { echo "gpu.sh: no NVIDIA GPU here (nvidia-smi not found)" >&2; exit 2; }
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    command -v ccache >/dev/null 2>&1 || echo "gpu.sh: ccache not found: the unpatched build compiles everything again" >&2
fi

stage "build, patched" bash scripts/build_llama.sh $KVCTL_BENCH_BUILD_ARGS
stage "build, unpatched" bash scripts/build_llama.sh $KVCTL_BENCH_BUILD_ARGS --no-patches
stage "model" "$py" -c "from bench.common import build, model; print(model('gpu', build()))"
status=0
stage "pressure" "$py" -m bench.pressure --model gpu --server-args "-ngl 99" --bands 8192 \
    --workloads equal-long,mixed --out gpu-pressure || status=1
stage "cost" "$py" -m bench.overhead --model gpu --server-args "-ngl 99" --pairs 20 --n-predict 128 \
    --out gpu-overhead || status=1
echo "gpu.sh: done in $(( SECONDS - start )) s; tables in bench/results/gpu-*.md"
exit "$status"
