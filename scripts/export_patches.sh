#!/usr/bin/env bash
# Maintainers: regenerate patches/ from a llama.cpp work tree where each patch is one commit
# on top of the pristine pinned tree (commit BASE).
#
#   scripts/export_patches.sh LLAMA_GIT_DIR BASE
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 LLAMA_GIT_DIR BASE" >&2; exit 2; }
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rm -f "$root"/patches/*.patch
git -C "$1" format-patch --quiet --no-signature --zero-commit --no-numbered "$2..HEAD" -o "$root/patches/"
ls "$root"/patches/*.patch
