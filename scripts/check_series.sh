#!/usr/bin/env bash
# Check the patch series the way a reviewer takes it: one patch at a time.
#
#   scripts/check_series.sh [--from N] [--only N,M,...] [--jobs N]
#
# For each patch of patches/, in order: it applies with `git apply` on top of the ones
# before it, it says why (a message body), it changes at most 350 lines outside
# tools/server/tests/, and llama-server builds with it and every patch before it. Run this
# before landing a change to patches/ (CI builds only the whole series). The build folder
# and ccache persist under ${XDG_CACHE_HOME:-$HOME/.cache}/kvctl/check-series/, so a second
# run recompiles only what the patches touch. --from N starts building at patch N (the
# earlier ones are still applied and checked); --only N,M builds only those prefixes (after a
# rebase that changed a few patches). Do not run it beside server tests.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
patches_dir="${KVCTL_PATCHES_DIR:-$root/patches}"
cache="${KVCTL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvctl}"
work="$cache/check-series"
max_lines=350
from=1
only=""
jobs="$(nproc 2>/dev/null || echo 2)"

die() { printf 'check_series: error: %s\n' "$*" >&2; exit 1; }
while [ $# -gt 0 ]; do
    case "$1" in
        --from) [ $# -ge 2 ] || die "--from needs a number"; from="$2"; shift ;;
        --only) [ $# -ge 2 ] || die "--only needs a list of numbers"; only=",$2,"; shift ;;
        --jobs|-j) [ $# -ge 2 ] || die "--jobs needs a value"; jobs="$2"; shift ;;
        -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument: $1" ;;
    esac
    shift
done
command -v ccache >/dev/null 2>&1 || die "ccache is required (apt-get install ccache): every prefix is a build"

mapfile -t patches < <(find "$patches_dir" -maxdepth 1 -name '*.patch' | LC_ALL=C sort)
[ ${#patches[@]} -gt 0 ] || die "no patches in $patches_dir"

# a fresh pinned tree each run, at a fixed path so that the build folder and ccache are reused
mkdir -p "$work"
rm -rf "$work/llama.cpp"
bash "$here/build_llama.sh" --extract "$work/llama.cpp" >/dev/null
src="$work/llama.cpp"
build="$work/build"
export CCACHE_BASEDIR="$work" CCACHE_NOHASHDIR=1
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DGGML_CCACHE=ON >"$work/cmake.log" 2>&1 || { tail -n 30 "$work/cmake.log" >&2; die "cmake configure failed"; }

failed=0
printf '%-4s %-68s %6s  %s\n' "#" "patch" "lines" "result"
for i in "${!patches[@]}"; do
    n=$((i + 1))
    p="${patches[$i]}"
    name="$(basename "$p")"
    problems=()
    if ! (cd "$src" && git apply --check "$p" 2>"$work/apply.err"); then
        printf '%-4s %-68s %6s  %s\n' "$n" "$name" "-" "DOES NOT APPLY"
        sed 's/^/    /' "$work/apply.err" >&2
        exit 1
    fi
    lines="$(cd "$src" && git apply --numstat "$p" | awk -F'\t' '$3 !~ /^tools\/server\/tests\// { s += $1 + $2 } END { print s + 0 }')"
    (cd "$src" && git apply "$p")
    [ "$lines" -le "$max_lines" ] || { problems+=("more than $max_lines lines"); failed=1; }
    # the message: everything between the Subject and the diffstat separator, past the subject itself
    body="$(awk '/^Subject:/ { s = 1; next } s && /^---$/ { exit } s' "$p" | sed '/^ /d' | grep -c '[^[:space:]]' || true)"
    [ "$body" -ge 2 ] || { problems+=("no message body saying why"); failed=1; }
    if [ "$n" -ge "$from" ] && { [ -z "$only" ] || [[ "$only" == *",$n,"* ]]; }; then
        t0=$(date +%s)
        targets=(llama-server)
        for t in test-memory-occupancy test-state-seq-copy test-mul-mat-width; do [ -f "$src/tests/$t.cpp" ] && targets+=("$t"); done
        # a patch that adds a test target changes tests/CMakeLists.txt: configure again so that make knows it
        [ ${#targets[@]} -gt 1 ] && cmake "$build" >>"$work/cmake.log" 2>&1
        if cmake --build "$build" --target "${targets[@]}" -j "$jobs" >"$work/build-$n.log" 2>&1; then
            problems+=("builds ($(( $(date +%s) - t0 )) s)")
        else
            grep -E 'error' "$work/build-$n.log" | head -n 20 >&2 || true
            problems+=("BUILD FAILED, see $work/build-$n.log")
            failed=1
        fi
    else
        problems+=("build skipped (--from/--only)")
    fi
    printf '%-4s %-68s %6s  %s\n' "$n" "$name" "$lines" "$(IFS=';'; echo "${problems[*]}")"
done
[ "$failed" = 0 ] || die "the series has problems (above)"
echo "check_series: all ${#patches[@]} patches apply, say why, stay within $max_lines lines and build"
