#!/usr/bin/env bash
# Make the base image the Containerfiles name (docker.io/library/debian:bookworm-slim) locally, from
# Debian's packages with mmdebstrap, for a build host that reaches Debian's archive but no image
# registry. Where Docker Hub is reachable, `podman pull` gives the real one and this is not needed.
#
#   deploy/containers/base-image.sh [--force]      (root; apt-get install mmdebstrap podman)
#
# minbase from bookworm, bookworm-updates and bookworm-security (the suites the official image has),
# apt's lists and caches removed, PATH set; SOURCE_DATE_EPOCH (default: Debian 12's release) makes the
# tarball the same for the same packages. Nothing of the build host goes in: a host behind a
# TLS-inspecting proxy gives the image builds its CA bundle by a mount (scripts/deploy_check.sh does).
set -euo pipefail
readonly NAME="docker.io/library/debian:bookworm-slim"
force=0
[ "${1:-}" = --force ] && force=1
if [ "$force" = 0 ] && podman image exists "$NAME"; then
    echo "base-image: $NAME exists (--force makes it again)" >&2
    exit 0
fi
command -v mmdebstrap >/dev/null || { echo "base-image: mmdebstrap is missing (apt-get install mmdebstrap)" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-1686355200}" mmdebstrap --quiet --variant=minbase \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    bookworm "$tmp/rootfs.tar" \
    "deb http://deb.debian.org/debian bookworm main" \
    "deb http://deb.debian.org/debian bookworm-updates main" \
    "deb http://deb.debian.org/debian-security bookworm-security main"
podman import --quiet --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' --change 'CMD ["bash"]' "$tmp/rootfs.tar" "$NAME" >/dev/null
echo "base-image: made $NAME ($(podman image inspect --format '{{.Size}}' "$NAME") bytes)" >&2
