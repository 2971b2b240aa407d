#!/usr/bin/env bash
# Build the patched llama-server that kvctl drives, and cache it outside the checkout.
#
#   scripts/build_llama.sh [--cuda] [--cuda-arch LIST] [--portable] [--ui|--no-ui] [--amx] [--no-patches] [--jobs N] [--force]
#   scripts/build_llama.sh --extract DIR     (only fetch the pinned source into DIR, unpatched)
#
# The source is the llama.cpp tree vendored in the PyPI sdist of llama-cpp-python 0.3.36
# (upstream commit 0c1e5709), verified by its sha256; with KVCTL_LLAMA_GIT_URL set, a git
# clone of the same commit instead. patches/*.patch are applied in order with `git apply`.
# The result is cached under ${XDG_CACHE_HOME:-$HOME/.cache}/kvctl/, keyed by source,
# patch series and flags, so an unchanged second run takes seconds.
#
# The WebUI (tools/ui of the pinned tree) is built with npm when npm is on PATH (or with --ui, which
# fails without it) and embedded in the server; its build is cached apart, keyed by the UI's sources,
# so a patch edit does not rebuild it. Without npm, or with --no-ui, the server has no WebUI.
#
# ggml's AMX path (the AMX extra buffer type that repacks quantized weights, compiled in when the native
# CPU build sees AMX on a Sapphire Rapids or newer Xeon) segfaults in ggml_backend_amx_mul_mat at the first
# quantized model's warm-up (llama.cpp issue 20824). On x86-64 it is left out by default with the CMake
# arguments -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" and the same -DCMAKE_CXX_FLAGS
# (-march=native stays; explicit -mno-* flags win over it); --amx builds it in again. The same holds
# with --no-patches, so the benchmarks' upstream build runs the same models.
#
# --portable builds for any x86-64-v3 CPU (AVX2, FMA, F16C, BMI2: Haswell, Zen and newer) or any
# ARMv8 CPU instead of this machine's (-DGGML_NATIVE=OFF): what the container images ship. With
# --cuda, --cuda-arch default leaves the CUDA architectures to ggml (its list: some as PTX only; an image build
# has no GPU to ask), and native (the default) builds for the GPUs present.
#
# Progress goes to stderr; the last line of stdout is the path of the llama-server binary.
# Environment: KVCTL_PATCHES_DIR (default: patches/ of this checkout), KVCTL_LLAMA_SDIST
# (a local copy of the sdist), KVCTL_LLAMA_SRC (a trimmed source tarball written by
# `bench/gpu.sh --prepare` from the verified sdist, for a machine without network),
# KVCTL_LLAMA_GIT_URL, KVCTL_CACHE_DIR, CMAKE_ARGS (extra flags).
set -euo pipefail

readonly SDIST_NAME="llama_cpp_python-0.3.36.tar.gz"
readonly SDIST_SPEC="llama-cpp-python==0.3.36"
readonly SDIST_URL="https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/$SDIST_NAME"
readonly SDIST_SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
readonly UPSTREAM_COMMIT="0c1e5709"

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
patches_dir="${KVCTL_PATCHES_DIR:-$root/patches}"
cache="${KVCTL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvctl}"

cuda=0
cuda_arch="native"
portable=0
ui=auto
use_patches=1
amx=0
force=0
extract=""
jobs="$(nproc 2>/dev/null || echo 2)"

log() { printf 'build_llama: %s\n' "$*" >&2; }
die() { printf 'build_llama: error: %s\n' "$*" >&2; exit 1; }
usage() { sed -n '2,33p' "$0" | sed 's/^# \{0,1\}//' >&2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --cuda) cuda=1 ;;
        --cuda-arch) [ $# -ge 2 ] || die "--cuda-arch needs a value"; cuda_arch="$2"; shift ;;
        --cuda-arch=*) cuda_arch="${1#*=}" ;;
        --portable) portable=1 ;;
        --ui) ui=1 ;;
        --no-ui) ui=0 ;;
        --no-patches) use_patches=0 ;;
        --amx) amx=1 ;;
        --jobs|-j) [ $# -ge 2 ] || die "--jobs needs a value"; jobs="$2"; shift ;;
        --force) force=1 ;;
        --extract) [ $# -ge 2 ] || die "--extract needs a folder"; extract="$2"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) usage; die "unknown argument: $1" ;;
    esac
    shift
done

for tool in cmake sha256sum tar git; do
    command -v "$tool" >/dev/null 2>&1 || die "'$tool' is required (apt-get install $tool)"
done

if [ "$ui" = auto ]; then
    if command -v npm >/dev/null 2>&1; then
        ui=1
    else
        ui=0
        log "npm not found: building the server without its WebUI (install Node.js and npm for it; --no-ui silences this)"
    fi
elif [ "$ui" = 1 ] && ! command -v npm >/dev/null 2>&1; then
    die "--ui needs npm (Node.js 20 or newer) on PATH"
fi

# --- what this build is: flags and patch series ------------------------------------------
flags=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF
       -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF
       -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_CCACHE=ON)
readonly NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
case "$(uname -m)" in
    x86_64|amd64)
        if [ "$amx" = 0 ]; then
            flags+=("-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX")
            amx_info="ggml's AMX path left out (-DCMAKE_C_FLAGS/-DCMAKE_CXX_FLAGS=\"$NO_AMX\"; --amx builds it in)"
        else
            amx_info="ggml's AMX path built in where the CPU has AMX (--amx; it segfaults on quantized models on some Xeons, llama.cpp issue 20824)"
        fi ;;
    *) amx_info="no AMX on $(uname -m)" ;;
esac
if [ "$portable" = 1 ]; then
    flags+=(-DGGML_NATIVE=OFF)
    # x86-64-v3, said outright: ggml turns these off by itself when SOURCE_DATE_EPOCH is set
    case "$(uname -m)" in
        x86_64|amd64) flags+=(-DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON) ;;
    esac
fi
if [ "$cuda" = 1 ]; then
    flags+=(-DGGML_CUDA=ON)
    [ "$cuda_arch" = default ] || flags+=("-DCMAKE_CUDA_ARCHITECTURES=$cuda_arch")
fi
# shellcheck disable=SC2206 # CMAKE_ARGS is a flag list by convention
[ -n "${CMAKE_ARGS:-}" ] && flags+=(${CMAKE_ARGS})

patches=()
if [ "$use_patches" = 1 ]; then
    [ -d "$patches_dir" ] || die "patch folder not found: $patches_dir"
    while IFS= read -r p; do patches+=("$p"); done < <(find "$patches_dir" -maxdepth 1 -name '*.patch' | LC_ALL=C sort)
fi

# the series' own libllama tests (tests/test-*.cpp of the patches), built beside the server and run by the suite
series_tests=(test-memory-occupancy test-state-seq-copy test-mul-mat-width)
series_hash="$( { for p in "${patches[@]+"${patches[@]}"}"; do basename "$p"; cat "$p"; done; } | sha256sum | cut -c1-16)"
# the UI's sources are fixed by the commit and the series, so whether it is embedded is all the key needs
key="$(printf '%s\n' "llama.cpp@$UPSTREAM_COMMIT" "$series_hash" "${flags[*]}" "ui=$ui" "tests=${series_tests[*]}" | sha256sum | cut -c1-16)"
entry="$cache/build/$key"
binary="$entry/bin/llama-server"

mkdir -p "$cache/build" "$cache/sdist" "$cache/tmp" "$cache/ui"

# one build at a time per cache: a test run and a quickstart must not race on the same entry
exec 9>"$cache/.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
fi

[ -n "$extract" ] && [ -e "$extract" ] && die "--extract: $extract exists"

# an entry from before the route table (src/server.cpp) and the server's test suite (server-tests/)
# were kept is rebuilt: ccache makes that quick
if [ "$force" = 0 ] && [ -z "$extract" ] && [ -x "$binary" ] && [ -f "$entry/src/server.cpp" ] && [ -f "$entry/server-tests/utils.py" ]; then
    log "cache hit: $entry (patches $series_hash; $amx_info)"
    echo "$binary"
    exit 0
fi

# --- fetch the pinned source -------------------------------------------------------------
work="$(mktemp -d "$cache/tmp/$key.XXXXXX")"
trap 'rm -rf "$work"' EXIT
src="$work/llama.cpp"

if [ -n "${KVCTL_LLAMA_SRC:-}" ]; then
    [ -f "$KVCTL_LLAMA_SRC" ] || die "KVCTL_LLAMA_SRC: $KVCTL_LLAMA_SRC is not a file"
    log "extracting llama.cpp from $(basename "$KVCTL_LLAMA_SRC") (trimmed by bench/gpu.sh --prepare)"
    tar -xJf "$KVCTL_LLAMA_SRC" -C "$work" llama.cpp
    grep -qx "llama.cpp@$UPSTREAM_COMMIT" "$src/KVCTL_SOURCE" 2>/dev/null \
        || die "$KVCTL_LLAMA_SRC is not a trimmed tree of llama.cpp $UPSTREAM_COMMIT (no matching KVCTL_SOURCE)"
elif [ -n "${KVCTL_LLAMA_GIT_URL:-}" ]; then
    log "cloning $KVCTL_LLAMA_GIT_URL at $UPSTREAM_COMMIT"
    git clone --quiet --filter=blob:none --no-checkout "$KVCTL_LLAMA_GIT_URL" "$src" >&2 \
        || die "git clone of $KVCTL_LLAMA_GIT_URL failed"
    git -C "$src" checkout --quiet "$UPSTREAM_COMMIT" >&2 || die "commit $UPSTREAM_COMMIT not found"
    rm -rf "$src/.git"
else
    sdist="${KVCTL_LLAMA_SDIST:-$cache/sdist/$SDIST_NAME}"
    if [ ! -f "$sdist" ]; then
        log "downloading $SDIST_SPEC (sdist, ~77 MB)"
        # the file's address on PyPI, fixed once uploaded; pip download is the fallback for a mirror
        # (it prepares the sdist's metadata first: minutes, building its build tools from source)
        mkdir -p "$work/dl"
        if ! python3 -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' \
                "$SDIST_URL" "$work/dl/$SDIST_NAME" 2>"$work/dl.err"; then
            log "$(tail -n 1 "$work/dl.err"); trying pip download"
            python3 -m pip download --quiet --no-deps --no-binary :all: "$SDIST_SPEC" -d "$work/dl" >&2 \
                || die "pip download $SDIST_SPEC failed (is the package index reachable?)"
        fi
        mv "$work/dl/$SDIST_NAME" "$sdist.part"
        mv "$sdist.part" "$sdist"
    fi
    actual="$(sha256sum "$sdist" | cut -d' ' -f1)"
    if [ "$actual" != "$SDIST_SHA256" ]; then
        [ -z "${KVCTL_LLAMA_SDIST:-}" ] && rm -f "$sdist"
        die "sha256 mismatch for $sdist: got $actual, want $SDIST_SHA256"
    fi
    log "extracting llama.cpp from $(basename "$sdist")"
    tar -xzf "$sdist" -C "$work" "llama_cpp_python-0.3.36/vendor/llama.cpp"
    mv "$work/llama_cpp_python-0.3.36/vendor/llama.cpp" "$src"
    # the sdist keeps a submodule pointer whose target is not shipped; git would trip on it
    rm -f "$src/.git"
fi

if [ -n "$extract" ]; then
    mkdir -p "$(dirname "$extract")"
    mv "$src" "$extract"
    log "extracted llama.cpp $UPSTREAM_COMMIT into $extract"
    echo "$extract"
    exit 0
fi

# --- apply the patch series --------------------------------------------------------------
for p in "${patches[@]+"${patches[@]}"}"; do
    name="$(basename "$p")"
    if ! (cd "$src" && git apply --check "$p" 2>"$work/apply.err"); then
        sed 's/^/    /' "$work/apply.err" >&2
        die "patch $name does not apply to llama.cpp $UPSTREAM_COMMIT"
    fi
    (cd "$src" && git apply "$p")
    log "applied $name"
done

# --- the WebUI: built with npm once per source tree, then embedded from tools/ui/dist --------
ui_info="none"
if [ "$ui" = 1 ]; then
    ui_hash="$(cd "$src/tools/ui" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)"
    ui_entry="$cache/ui/$ui_hash"
    if [ -f "$ui_entry/dist/index.html" ]; then
        log "WebUI cache hit: $ui_entry"
    else
        log "building the WebUI with npm $(npm --version) (node $(node --version 2>/dev/null || echo '?'); a cold build takes ~3 min)"
        cp -r "$src/tools/ui" "$work/ui"
        if ! (cd "$work/ui" && npm ci --no-audit --no-fund --loglevel=error && npm run build) >"$work/ui.log" 2>&1; then
            tail -n 30 "$work/ui.log" >&2
            die "the WebUI build failed (log above); --no-ui builds the server without it"
        fi
        [ -f "$work/ui/dist/index.html" ] || die "the WebUI build wrote no dist/index.html"
        rm -rf "$ui_entry.part" && mkdir -p "$ui_entry.part"
        mv "$work/ui/dist" "$ui_entry.part/dist"
        rm -rf "$work/ui" "$ui_entry" && mv "$ui_entry.part" "$ui_entry"
        log "WebUI built: $ui_entry"
    fi
    # scripts/ui-assets.cmake embeds tools/ui/dist first, before any npm build or download
    cp -r "$ui_entry/dist" "$src/tools/ui/dist"
    ui_info="$ui_hash ($ui_entry)"
fi

# --- build -------------------------------------------------------------------------------
log "$amx_info"
log "configuring (${flags[*]})"
export CCACHE_BASEDIR="$work" CCACHE_NOHASHDIR=1   # hit the ccache across temporary folders
cmake -S "$src" -B "$work/build" "${flags[@]}" >"$work/cmake.log" 2>&1 \
    || { tail -n 40 "$work/cmake.log" >&2; die "cmake configure failed (log above)"; }
log "building llama-server with $jobs jobs (a cold CPU build takes ~13 min on 2 cores)"
targets=(llama-server)
for t in "${series_tests[@]}"; do [ -f "$src/tests/$t.cpp" ] && targets+=("$t"); done
if ! cmake --build "$work/build" --target "${targets[@]}" -j "$jobs" >"$work/build.log" 2>&1; then
    grep -E 'error|Error' "$work/build.log" | head -n 40 >&2 || true
    tail -n 20 "$work/build.log" >&2
    die "build failed (log above)"
fi

# --- install into the cache atomically ---------------------------------------------------
stage="$work/entry"
mkdir -p "$stage/bin" "$stage/vocab" "$stage/src"
cp "$work/build/bin/llama-server" "$stage/bin/"
for t in "${targets[@]:1}"; do cp "$work/build/bin/$t" "$stage/bin/"; done
# the server's route table, for the test that checks the proxy classifies every route (tests/unit/test_routes.py)
cp "$src/tools/server/server.cpp" "$stage/src/"
# llama.cpp's own server tests, upstream's and the series', run offline by tests/upstream/runner.py
cp -r "$src/tools/server/tests" "$stage/server-tests"
cp "$src"/models/ggml-vocab-llama-spm.gguf "$src"/models/ggml-vocab-qwen35.gguf "$stage/vocab/"
{
    echo "source: llama.cpp $UPSTREAM_COMMIT"
    echo "patches: $series_hash"
    for p in "${patches[@]+"${patches[@]}"}"; do echo "  $(basename "$p")"; done
    echo "flags: ${flags[*]}"
    echo "webui: $ui_info"
    echo "amx: $amx_info"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$stage/BUILD_INFO"
rm -rf "$entry"
mv "$stage" "$entry"
log "built $binary"
echo "$binary"
