#!/usr/bin/env bash
# The GPU benchmarks as one prepared run, for a lent NVIDIA machine (about 10 minutes on one H200):
#
#   bench/gpu.sh [--budget-s 560] [--dry-run]
#   bench/gpu.sh --prepare        (on the CPU machine, before a GPU is lent)
#
# 1. builds the patched and the unpatched llama-server with CUDA (scripts/build_llama.sh --cuda,
#    cached like every build; ccache makes the second build a relink of the patched files),
# 2. writes the 'gpu' random-weight model (0.85 B parameters, F32, testkit/models.py),
# 3. measures park and resume at memory speed (bench/park_speed.py: 16 MiB to 1 GiB snapshots, -fa on
#    and off, pinned and pageable arena, the other streams' decode stall), bench/results/gpu-park-speed.md,
#    and in every cache layout a GPU runs (f16 with -fa on and off, q8_0), one contiguous request at a
#    time, bench/results/gpu-park-layouts.md,
# 4. runs the pressure benchmark (8192 band, equal-long and mixed, every mode) and the cost
#    benchmark (patched vs unpatched and the whole stack, 20 pairs) with every layer on the GPU,
#    writing bench/results/gpu-pressure.md|png and bench/results/gpu-overhead.md,
# 5. checks the exact mode (--exact): solo against concurrent continuations and its cost in tokens/s
#    beside the default, bench/results/gpu-exact-mode.md.
# Each stage gets what is left of the budget; a stage that runs out is stopped and the script
# says which.
#
# The lent machine has no network, Python 3.12 with aiohttp and numpy only, and receives the working
# tree plus at most 64 MiB of carried files. --prepare writes them into .gpu-carry/ (git-ignored):
# the pinned llama.cpp tree without its docs, media, tests and models other than the two vocabularies
# (llama.cpp.tar.xz, built by scripts/build_llama.sh through KVCTL_LLAMA_SRC), and wheels for
# Python 3.12 of every other package the benchmarks import; it checks the total against 64 MiB.
# Carry it: the device tool's `carry: [".gpu-carry"]`. On the lent machine gpu.sh then installs the
# wheels into .gpu-venv (system packages visible) and builds from the carried tree.
# KVCTL_CUDA_ARCH (default: native) picks the CUDA architectures.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

budget=560
dry=0
prepare=0
while [ $# -gt 0 ]; do
    case "$1" in
        --budget-s) budget="$2"; shift ;;
        --dry-run) dry=1 ;;
        --prepare) prepare=1 ;;
        -h|--help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu.sh: unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done

carry=.gpu-carry
carry_max=$(( 64 * 1024 * 1024 ))
# what the benchmarks import beyond the lent machine's aiohttp and numpy
wheels=(pydantic-settings structlog prometheus-client psutil nvidia-ml-py gguf)

if [ "$prepare" = 1 ]; then
    rm -rf "$carry" && mkdir -p "$carry/wheels"
    tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
    bash scripts/build_llama.sh --extract "$tmp/llama.cpp" >/dev/null
    (
        cd "$tmp/llama.cpp"
        rm -rf docs media benches tests examples/model-conversion .github
        find models -type f ! -name ggml-vocab-llama-spm.gguf ! -name ggml-vocab-qwen35.gguf -delete
        echo "llama.cpp@$(sed -n 's/^readonly UPSTREAM_COMMIT="\(.*\)"/\1/p' "$OLDPWD/scripts/build_llama.sh")" > KVCTL_SOURCE
    )
    tar -C "$tmp" -cf - llama.cpp | xz -T0 -6 > "$carry/llama.cpp.tar.xz"
    python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$carry/wheels" "${wheels[@]}"
    rm -f "$carry"/wheels/numpy-* "$carry"/wheels/aiohttp-*  # the lent machine has them
    total="$(du -sb "$carry" | cut -f1)"
    echo "gpu.sh --prepare: $carry holds $(( total / 1024 / 1024 )) MiB ($(ls "$carry/wheels" | wc -l) wheels)"
    [ "$total" -le "$carry_max" ] || { echo "gpu.sh --prepare: over the 64 MiB the device tool carries" >&2; exit 1; }
    exit 0
fi

py="${KVCTL_PYTHON:-python3}"
[ -x .venv/bin/python ] && py=.venv/bin/python
if [ -d "$carry" ] && [ "$dry" = 0 ]; then
    export KVCTL_LLAMA_SRC="$PWD/$carry/llama.cpp.tar.xz"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # controller, testkit, bench without installing kvctl
    if ! "$py" -c "import pydantic_settings, structlog, gguf" 2>/dev/null; then
        python3 -m venv --system-site-packages .gpu-venv
        .gpu-venv/bin/python -m pip install --quiet --no-index --find-links "$carry/wheels" "${wheels[@]}"
        py=.gpu-venv/bin/python
    fi
fi
# no WebUI: the device machine reaches no npm registry, and the benchmarks never open it
export KVCTL_BENCH_BUILD_ARGS="--cuda --cuda-arch ${KVCTL_CUDA_ARCH:-native} --no-ui"
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
stage "model" "$py" -c "from bench.common import build, model; print(model('gpu', build()), model('kvheavy', build()))"
status=0
stage "park speed" "$py" -m bench.park_speed --server-args "-ngl 99" --pinned on,off --slices 16M \
    --out gpu-park-speed || status=1
stage "park layouts" "$py" -m bench.park_speed --server-args "-ngl 99" --slices 16M --fa on,off --cache f16,q8_0 \
    --prompt-mib auto --long one --rss off --out gpu-park-layouts || status=1
stage "pressure" "$py" -m bench.pressure --model gpu --server-args "-ngl 99" --bands 8192 \
    --workloads equal-long,mixed --out gpu-pressure || status=1
stage "cost" "$py" -m bench.overhead --model gpu --server-args "-ngl 99" --pairs 20 --n-predict 128 \
    --out gpu-overhead || status=1
# the exact mode on CUDA: how many continuations equal their solo run (docs/gpu.md says which kernels
# it cannot make invariant there) and what it costs at 1, 4 and 16 streams
stage "exact mode" "$py" -m bench.exact_mode --model gpu --server-args "-ngl 99" --rounds 1 --fa on \
    --out gpu-exact-mode || status=1
echo "gpu.sh: done in $(( SECONDS - start )) s; tables in bench/results/gpu-*.md"
exit "$status"
