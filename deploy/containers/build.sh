#!/usr/bin/env bash
# Build kvctl's container images with podman (or buildah), and print the Kubernetes manifests that name them.
#
#   deploy/containers/build.sh [server] [server-cuda] [kvctl] [--push]   (default: server kvctl)
#   deploy/containers/build.sh manifests [FILE...]                       (default: deploy/k8s/kvctl-sidecar.yaml)
#
# KVCTL_REGISTRY (default localhost/kvctl, podman's name for local images) is the one place the images
# live: the images are tagged $KVCTL_REGISTRY/llama-server:VERSION (CPU), .../llama-server:VERSION-cuda
# and .../kvctl:VERSION, VERSION being pyproject.toml's. The manifests in deploy/k8s name the
# localhost/kvctl ones; `manifests` prints them with $KVCTL_REGISTRY instead, for kubectl:
#
#   KVCTL_REGISTRY=registry.example.com/kvctl deploy/containers/build.sh server-cuda kvctl --push
#   KVCTL_REGISTRY=registry.example.com/kvctl deploy/containers/build.sh manifests | kubectl apply -f -
#
# BUILD_ARGS passes more flags to podman build (e.g. "--build-arg CUDA_ARCHITECTURES=90").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
registry="${KVCTL_REGISTRY:-localhost/kvctl}"
registry="${registry%/}"
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n 1)"
[ -n "$version" ] || { echo "build.sh: no version in pyproject.toml" >&2; exit 1; }

if [ "${1:-}" = manifests ]; then
    shift
    [ $# -gt 0 ] || set -- deploy/k8s/kvctl-sidecar.yaml
    first=1
    for f in "$@"; do
        [ "$first" = 1 ] || echo "---"
        first=0
        sed "s|image: localhost/kvctl/|image: $registry/|" "$f"
    done
    exit 0
fi

push=0 targets=()
for arg in "$@"; do
    case "$arg" in
        server|server-cuda|kvctl) targets+=("$arg") ;;
        --push) push=1 ;;
        -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build.sh: unknown argument: $arg (try --help)" >&2; exit 2 ;;
    esac
done
[ ${#targets[@]} -gt 0 ] || targets=(server kvctl)
if [ "$push" = 1 ] && [ -z "${KVCTL_REGISTRY:-}" ]; then
    echo "build.sh: --push needs KVCTL_REGISTRY (where to push; localhost/kvctl is podman's local store)" >&2
    exit 2
fi
engine="$(command -v podman || command -v buildah || true)"
[ -n "$engine" ] || { echo "build.sh: needs podman or buildah (apt-get install podman)" >&2; exit 1; }

for t in "${targets[@]}"; do
    case "$t" in
        server) file=llama-server.Containerfile tag="$registry/llama-server:$version" ;;
        server-cuda) file=llama-server-cuda.Containerfile tag="$registry/llama-server:$version-cuda" ;;
        kvctl) file=kvctl.Containerfile tag="$registry/kvctl:$version" ;;
    esac
    echo "build.sh: building $tag from deploy/containers/$file" >&2
    # shellcheck disable=SC2086 # BUILD_ARGS is a flag list
    "$engine" build --layers -f "deploy/containers/$file" --build-arg "VERSION=$version" ${BUILD_ARGS:-} -t "$tag" .
    [ "$push" = 0 ] || "$engine" push "$tag"
done
