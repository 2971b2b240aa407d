#!/usr/bin/env bash
# Run llama.cpp's own server test suite offline against the patched build and compare each
# test with its result on the unpatched build (tests/upstream/baseline.json).
#
#   scripts/upstream_tests.sh [FILE...]           the whole suite, or FILEs (unit/test_x.py)
#   scripts/upstream_tests.sh --record [FILE...]  rewrite the baseline from the unpatched build
#
# Needs the virtual environment of scripts/test.sh. Builds (cached) what it runs against.
# Do not run it beside a build or other server tests: its servers use one core each.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${KVCTL_VENV:-$root/.venv}/bin/python"
[ -x "$python" ] || { echo "upstream_tests: run scripts/test.sh once first (it creates .venv)" >&2; exit 1; }

record=()
files=()
for arg in "$@"; do
    case "$arg" in
        --record) record=(--record) ;;
        -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) files+=("$arg") ;;
    esac
done
if [ ${#record[@]} -gt 0 ]; then
    binary="$(bash scripts/build_llama.sh --no-patches | tail -n 1)"
else
    binary="$(bash scripts/build_llama.sh | tail -n 1)"
fi
[ ${#files[@]} -gt 0 ] || files=(--all)
exec "$python" -m tests.upstream.runner --binary "$binary" "${record[@]}" "${files[@]}"
