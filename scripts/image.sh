#!/usr/bin/env bash
# The proxy's container image (Dockerfile): `make image` and `make image-test` run this.
#
#   scripts/image.sh engine   prints the container tool to use, installing podman if there is none
#   scripts/image.sh base     prints the base image to build on (see below), making it if need be
#   scripts/image.sh build    builds pdserve:<package version>, prints name:tag and digest
#
# The tool is $CONTAINER_ENGINE if set, else podman if installed, else docker if its daemon answers, else
# podman installed with apt-get (Debian/Ubuntu, as root). Podman runs with this directory's containers.conf
# and storage.conf unless CONTAINERS_CONF / CONTAINERS_STORAGE_CONF say otherwise.
#
# The base is $BASE if set, else python:3.12-slim (the Dockerfile's default) if it can be pulled, else (or
# with PDSERVE_IMAGE_LOCAL_BASE=1) a Debian bookworm rootfs with python3, python3-venv and ca-certificates,
# made by debootstrap from the host's own apt mirror, cached as build/image/base-bookworm.tar and imported
# as localhost/pdserve-base:bookworm. Delete the tarball to make it again.
set -euo pipefail
cd "$(dirname "$0")/.."
here=$PWD/scripts/containers
cache=$PWD/build/image
base_tar=$cache/base-bookworm.tar
local_base=localhost/pdserve-base:bookworm
export CONTAINERS_CONF=${CONTAINERS_CONF:-$here/containers.conf}
export CONTAINERS_STORAGE_CONF=${CONTAINERS_STORAGE_CONF:-$here/storage.conf}

say() { echo "image: $*" >&2; }

apt_install() {
  # Only what is missing, so a second run installs nothing and needs no network.
  local missing=()
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null || { say "need ${missing[*]} and there is no apt-get: install them"; exit 1; }
  [ "$(id -u)" -eq 0 ] || { say "need ${missing[*]}: run as root, or install them"; exit 1; }
  say "apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

engine() {
  if [ -n "${CONTAINER_ENGINE:-}" ]; then echo "$CONTAINER_ENGINE"; return; fi
  if command -v podman >/dev/null; then echo podman; return; fi
  # A docker client without a daemon (as on some CI runners) cannot build.
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then echo docker; return; fi
  # runc: crun fails on setrlimit on some hosts; containers.conf names runc.
  apt_install podman buildah runc fuse-overlayfs >&2
  echo podman
}

has_image() {
  if [ "$1" = podman ]; then podman image exists "$2"; else docker image inspect "$2" >/dev/null 2>&1; fi
}

# The host's first Debian mirror, so debootstrap fetches where apt-get does (none found: debootstrap's own).
debian_mirror() {
  local uri
  uri=$(grep -hs -E '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -1 || true)
  [ -n "$uri" ] || uri=$(grep -hs -E '^deb ' /etc/apt/sources.list | awk '{print $2}' | grep -v security | head -1 || true)
  echo "${uri:-}"
}

base() {
  if [ -n "${BASE:-}" ]; then echo "$BASE"; return; fi
  local tool
  tool=$(engine)
  if [ "${PDSERVE_IMAGE_LOCAL_BASE:-0}" != 1 ]; then
    if has_image "$tool" python:3.12-slim || timeout 300 "$tool" pull -q python:3.12-slim >/dev/null 2>&1; then
      echo python:3.12-slim
      return
    fi
    say "python:3.12-slim cannot be pulled here: building on a local Debian base instead"
  fi
  if [ ! -s "$base_tar" ]; then
    apt_install debootstrap >&2
    local rootfs=$cache/rootfs mirror start
    mirror=$(debian_mirror)
    start=$(date +%s)
    say "making the base: debootstrap bookworm from ${mirror:-the default mirror} (about 2 minutes, once)"
    rm -rf "$rootfs" && mkdir -p "$rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
      bookworm "$rootfs" ${mirror:+"$mirror"} >"$cache/debootstrap.log" 2>&1 \
      || { say "debootstrap failed; last lines of $cache/debootstrap.log:"; tail -20 "$cache/debootstrap.log" >&2; exit 1; }
    # The package lists and downloaded .debs are the bulk of what an image need not carry.
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/log/*
    tar -C "$rootfs" --numeric-owner -cf "$base_tar.tmp" .
    mv "$base_tar.tmp" "$base_tar"
    rm -rf "$rootfs"
    say "base made in $(($(date +%s) - start)) s: $base_tar ($(du -m "$base_tar" | cut -f1) MB)"
    "$tool" rmi -f "$local_base" >/dev/null 2>&1 || true
  fi
  if ! has_image "$tool" "$local_base"; then
    "$tool" import -q --change 'CMD ["/bin/bash"]' "$base_tar" "$local_base" >/dev/null
  fi
  echo "$local_base"
}

version() {
  python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])'
}

build() {
  local tool from ver name start args=()
  tool=$(engine)
  from=$(base)
  ver=$(version)
  name=${PDSERVE_IMAGE:-pdserve}:$ver
  args+=(--build-arg "BASE=$from" --build-arg "VERSION=$ver")
  args+=(--build-arg "REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)")
  args+=(--build-arg "SOURCE=${PDSERVE_IMAGE_SOURCE:-$(git config --get remote.origin.url 2>/dev/null || echo unknown)}")
  # pip in the build verifies TLS with the host's CA bundle where the host has one (a TLS-inspecting
  # proxy's CA, say); as a secret it never lands in a layer.
  local ca=${PDSERVE_IMAGE_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
  [ -s "$ca" ] && args+=(--secret "id=ca,src=$ca")
  if [ "$tool" = podman ]; then
    # HEALTHCHECK is a Docker-format field: the OCI format would drop it.
    args+=(--format docker --network host)
  fi
  start=$(date +%s)
  say "building $name on $from with $tool"
  "$tool" build "${args[@]}" -t "$name" -f Dockerfile . >&2
  say "built in $(($(date +%s) - start)) s, $("$tool" image inspect --format '{{.Size}}' "$name" | awk '{printf "%.0f MB", $1 / 1e6}')"
  echo "$name $("$tool" image inspect --format '{{.Digest}}' "$name")"
}

case "${1:-}" in
  engine) engine ;;
  base) base ;;
  build) build ;;
  version) version ;;
  *) echo "usage: $0 engine|base|build|version" >&2; exit 2 ;;
esac
