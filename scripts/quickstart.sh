#!/usr/bin/env bash
# Build and run kvctl's main job on this machine.
#
#   scripts/quickstart.sh            # patched llama-server on the generated demo model, port 8080
#   MODEL=/path/to.gguf scripts/quickstart.sh
#
# Creates .venv, installs kvctl, builds the patched server (cached), generates the demo
# model unless MODEL is given, and runs the server in the foreground until Ctrl-C.
# Settings: MODEL, PORT (8080), CTX (8192), SLOTS (4), THREADS (all cores), EXTRA_ARGS.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

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
if [ -z "$model" ]; then
    model="${XDG_CACHE_HOME:-$HOME/.cache}/kvctl/models/demo-bench.gguf"
    mkdir -p "$(dirname "$model")"
    echo "quickstart: demo model (random weights) at $model" >&2
    python -m controller.testmodels llama --vocab "$vocab" --out "$model" --size bench >&2
fi

port="${PORT:-8080}"
echo "quickstart: patched llama-server on http://127.0.0.1:$port (GET /kv, POST /slots/N?action=park|resume)" >&2
# shellcheck disable=SC2086 # EXTRA_ARGS is a flag list
exec "$bin" -m "$model" --host 127.0.0.1 --port "$port" -c "${CTX:-8192}" -np "${SLOTS:-4}" -kvu \
    --slots --metrics -t "${THREADS:-$(nproc)}" ${EXTRA_ARGS:-}
