#!/usr/bin/env bash
# Build and run kvctl's main job: the patched llama-server with kvctl in front of it.
#
#   scripts/quickstart.sh            # run until Ctrl-C; clients use http://127.0.0.1:8080/v1
#   scripts/quickstart.sh --demo     # a burst of chats that overflows the pool, then stop
#   MODEL=/path/to.gguf scripts/quickstart.sh
#
# Creates .venv, installs kvctl, builds the patched server (cached), generates the random-weight
# demo model unless MODEL is given, and starts `kvctl run --spawn` (the proxy on PORT, the admin
# API on ADMIN_PORT, the server on SERVER_PORT). --demo sends CHATS concurrent chats of TOKENS
# tokens, prints how many completed and how many parks it took, stops everything it started, and
# exits 0 only if every chat completed.
# Settings: MODEL, PORT (8080), ADMIN_PORT (8091), SERVER_PORT (8081), CTX (8192), SLOTS (4),
# THREADS (1 for the demo model, else all cores), CHATS (4), TOKENS (3000), EXTRA_ARGS (server flags).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

demo=0
for arg in "$@"; do
    case "$arg" in
        --demo) demo=1 ;;
        -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "quickstart: unknown argument: $arg (try --help)" >&2; exit 2 ;;
    esac
done

venv="${KVCTL_VENV:-$root/.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
if [ ! -f "$venv/.kvctl-installed" ] || [ pyproject.toml -nt "$venv/.kvctl-installed" ]; then
    echo "quickstart: installing kvctl" >&2
    python -m pip install --quiet --upgrade pip >&2
    python -m pip install --quiet -e ".[test]" >&2
    touch "$venv/.kvctl-installed"
fi

bin="$(bash scripts/build_llama.sh | tail -n 1)"
vocab="$(dirname "$(dirname "$bin")")/vocab/ggml-vocab-llama-spm.gguf"

model="${MODEL:-}"
threads="${THREADS:-$(nproc)}"
if [ -z "$model" ]; then
    model="${XDG_CACHE_HOME:-$HOME/.cache}/kvctl/models/demo-tiny.gguf"
    mkdir -p "$(dirname "$model")"
    echo "quickstart: demo model (random weights, tiny) at $model" >&2
    python -m controller.testmodels llama --vocab "$vocab" --out "$model" --size tiny >&2
    threads="${THREADS:-1}"
fi

port="${PORT:-8080}" admin="${ADMIN_PORT:-8091}" sport="${SERVER_PORT:-8081}"
# shellcheck disable=SC2206 # EXTRA_ARGS is a flag list
server=("$bin" -m "$model" --host 127.0.0.1 --port "$sport" -c "${CTX:-8192}" -np "${SLOTS:-4}" -kvu
        --slots --metrics -t "$threads" ${EXTRA_ARGS:-})
kvctl=(kvctl run --upstream "http://127.0.0.1:$sport" --listen "127.0.0.1:$port" --admin "127.0.0.1:$admin"
       --spawn -- "${server[@]}")

if [ "$demo" = 0 ]; then
    echo "quickstart: clients use http://127.0.0.1:$port/v1 ; status: kvctl status --admin 127.0.0.1:$admin" >&2
    exec "${kvctl[@]}"
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
echo "quickstart: starting the stack (log: $log)" >&2
for _ in $(seq 600); do
    if curl -fsS "http://127.0.0.1:$admin/readyz" >/dev/null 2>&1; then break; fi
    kill -0 "$pid" 2>/dev/null || { tail -n 30 "$log" >&2; echo "quickstart: kvctl exited" >&2; exit 1; }
    sleep 0.2
done
python -m controller.demo --proxy "http://127.0.0.1:$port" --admin "http://127.0.0.1:$admin" \
    --server "http://127.0.0.1:$sport" --chats "${CHATS:-4}" --tokens "${TOKENS:-3000}"
