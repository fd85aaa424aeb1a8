#!/usr/bin/env bash
# Build the zerobubble images with podman, from nothing but a Debian mirror and a Python
# package index: where the registry base (python:3.11-slim) cannot be pulled, a Debian bookworm
# root filesystem made with debootstrap becomes the base image. Run from anywhere, as root:
#
#   deploy/build_images.sh              # CPU image (both roles)
#   deploy/build_images.sh --cuda       # and the CUDA image (its torch from PyPI, a CUDA build)
#   deploy/build_images.sh --registry   # bases from the registry: python:3.11-slim, nvidia/cuda
#
# Environment:
#   IMAGE            the CPU image's tag (default localhost/zerobubble:0.1.0)
#   CUDA_IMAGE       the CUDA image's tag (default localhost/zerobubble:0.1.0-cuda)
#   BASE_IMAGE       the local base's tag (default localhost/zerobubble-base:bookworm)
#   DEBIAN_MIRROR    where debootstrap fetches packages (default: the host's apt source)
#   TORCH_WHEELS     a folder holding the CPU torch wheel, searched before the index (default:
#                    pip's find-links on this host, if any)
#   TORCH_INDEX_URL  the index torch and its dependencies come from (default: PyPI when
#                    TORCH_WHEELS holds the wheel, else PyTorch's CPU index)
#   BUILD_CA         a CA bundle pip trusts during the build (default: the host's bundle, so an
#                    intercepting proxy the host trusts works; it is mounted, not copied in)
#   PODMAN           the podman command (default: podman --runtime runc --cgroup-manager=cgroupfs,
#                    which also works on hosts whose cgroup layout crun refuses)
#
# The base is built once and kept (its tag names a digest of its package list); podman's layer
# cache keeps torch and the dependencies between builds, so a rebuild after a source change
# reinstalls only the project. Each source change leaves the previous build's project layers
# behind (about 1 GB); `podman image prune` frees them, and with them the layer cache.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
IMAGE="${IMAGE:-localhost/zerobubble:0.1.0}"
CUDA_IMAGE="${CUDA_IMAGE:-localhost/zerobubble:0.1.0-cuda}"
BASE_REPO="${BASE_REPO:-localhost/zerobubble-base}"
SUITE=bookworm
# Python 3.11 with venv (and so pip), g++ for the CPU kernels (they include no Python header),
# the CA store for pip's TLS. minbase: no init system or other daemons in a container.
BASE_PACKAGES="python3,python3-venv,g++,ca-certificates"
PODMAN="${PODMAN:-podman --runtime runc --cgroup-manager=cgroupfs}"
# podman's default ulimits exceed what some hosts allow a container.
ULIMITS=(--ulimit nofile=1024:1024 --ulimit nproc=4096:4096)
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/zerobubble/images"

with_cuda=0
registry=0
for arg in "$@"; do
    case "$arg" in
        --cuda) with_cuda=1 ;;
        --registry) registry=1 ;;
        -h | --help) sed -n '2,27p' "$0"; exit 0 ;;
        *) echo "unknown argument: $arg" >&2; exit 2 ;;
    esac
done

log() { printf '[build_images %s] %s\n' "$(date +%T)" "$*" >&2; }

need() {
    command -v "$1" >/dev/null 2>&1 && return 0
    echo "$1 not found: install it (Debian/Ubuntu: apt-get install podman runc debootstrap)" >&2
    exit 1
}

# The mirror the host's apt uses, so the base comes from the same place as the host's packages.
debian_mirror() {
    if [ -n "${DEBIAN_MIRROR:-}" ]; then echo "$DEBIAN_MIRROR"; return; fi
    local uri
    uri=$(grep -rhoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
        | grep -oE 'https?://[^ ]+' | head -n1 || true)
    echo "${uri:-http://deb.debian.org/debian}"
}

base_tag() {
    printf '%s' "$SUITE $BASE_PACKAGES" | sha256sum | cut -c1-12
}

# debootstrap a minimal bookworm and import it as an image; skipped when the tag exists.
build_base() {
    local tag="$BASE_REPO:$SUITE-$(base_tag)"
    if $PODMAN image exists "$tag"; then
        log "base $tag exists"
        echo "$tag"
        return
    fi
    need debootstrap
    local root="$CACHE/rootfs-$SUITE"
    rm -rf "$root"
    mkdir -p "$root"
    log "debootstrap $SUITE ($BASE_PACKAGES) from $(debian_mirror) into $root"
    debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$root" "$(debian_mirror)" >&2
    # A container needs no package cache, docs or locales; apt lists are fetched again when needed.
    chroot "$root" apt-get clean
    rm -rf "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/*
    echo "deb $(debian_mirror) $SUITE main" >"$root/etc/apt/sources.list"
    log "importing $tag"
    tar -C "$root" --numeric-owner -c . \
        | $PODMAN import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'CMD ["/bin/bash"]' - "$tag" >&2
    rm -rf "$root"
    echo "$tag"
}

# pip's find-links on this host: where a local CPU torch wheel lies, if anywhere.
default_wheels() {
    if [ -n "${TORCH_WHEELS:-}" ]; then echo "$TORCH_WHEELS"; return; fi
    local links="${PIP_FIND_LINKS:-}"
    [ -z "$links" ] && links=$(pip3 config get global.find-links 2>/dev/null || true)
    for dir in $links; do
        if compgen -G "$dir/torch-*+cpu-*.whl" >/dev/null; then echo "$dir"; return; fi
    done
}

main() {
    need podman
    cd "$REPO"
    local args=(--layers --network host "${ULIMITS[@]}")
    local ca="${BUILD_CA:-/etc/ssl/certs/ca-certificates.crt}"
    if [ -f "$ca" ]; then
        args+=(--volume "$ca:/run/build-ca.crt:ro" --build-arg PIP_BUILD_CERT=/run/build-ca.crt)
    fi
    local wheels
    wheels=$(default_wheels)
    local cpu_args=()
    if [ -n "$wheels" ]; then
        log "torch wheels from $wheels"
        cpu_args+=(--volume "$wheels:/run/wheels:ro" --build-arg TORCH_FIND_LINKS=/run/wheels
            --build-arg "TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://pypi.org/simple}")
    elif [ -n "${TORCH_INDEX_URL:-}" ]; then
        cpu_args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
    fi
    local base_args=() cuda_base_args=()
    if [ "$registry" = 0 ]; then
        local base
        base=$(build_base)
        base_args=(--build-arg "BASE_IMAGE=$base")
        cuda_base_args=(--build-arg "CUDA_BASE=$base" --build-arg "TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://pypi.org/simple}")
    fi
    log "building $IMAGE"
    local start=$SECONDS
    $PODMAN build "${args[@]}" "${base_args[@]}" "${cpu_args[@]}" -f deploy/Dockerfile -t "$IMAGE" . >&2
    log "built $IMAGE in $((SECONDS - start)) s: $($PODMAN image inspect --format '{{.Size}}' "$IMAGE" | numfmt --to=si)B"
    if [ "$with_cuda" = 1 ]; then
        log "building $CUDA_IMAGE"
        start=$SECONDS
        $PODMAN build "${args[@]}" "${cuda_base_args[@]}" -f deploy/Dockerfile.cuda -t "$CUDA_IMAGE" . >&2
        log "built $CUDA_IMAGE in $((SECONDS - start)) s: $($PODMAN image inspect --format '{{.Size}}' "$CUDA_IMAGE" | numfmt --to=si)B"
    fi
}

main
