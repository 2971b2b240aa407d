#!/usr/bin/env bash
# Make the base image the Containerfiles name (docker.io/library/debian:bookworm-slim) locally, from
# Debian's packages with mmdebstrap, for a build host that reaches Debian's archive but no image
# registry. Where Docker Hub is reachable, `podman pull` gives the real one and this is not needed.
#
#   deploy/containers/base-image.sh [--force]      (root; apt-get install mmdebstrap podman)
#
# minbase plus ca-certificates, apt's lists and caches removed. The build host's own CAs
# (/usr/local/share/ca-certificates, e.g. a TLS-inspecting proxy's) are added, so that the image
# builds reach the package registries the way the host does. SOURCE_DATE_EPOCH (default: the
# Debian release's date) makes the tarball the same for the same packages.
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
hooks=()
if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
    hooks+=(--customize-hook='mkdir -p "$1/usr/local/share/ca-certificates"'
            --customize-hook='cp /usr/local/share/ca-certificates/*.crt "$1/usr/local/share/ca-certificates/"'
            --customize-hook='chroot "$1" update-ca-certificates >/dev/null')
fi
SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-1686355200}" mmdebstrap --quiet --variant=minbase \
    --include=ca-certificates \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    "${hooks[@]+"${hooks[@]}"}" bookworm "$tmp/rootfs.tar" http://deb.debian.org/debian
podman import --quiet --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' --change 'CMD ["bash"]' "$tmp/rootfs.tar" "$NAME" >/dev/null
echo "base-image: made $NAME ($(podman image inspect --format '{{.Size}}' "$NAME") bytes)" >&2
