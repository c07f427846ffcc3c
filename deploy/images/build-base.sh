#!/usr/bin/env bash
# Builds the Debian base image locally: no registry is needed (or reachable) on the
# project's machines, so the rootfs comes from Debian's package mirror via debootstrap
# and is imported with `docker import`. Users with a registry can skip this and pass a
# public base to the Dockerfiles (`--build-arg BASE=debian:bookworm-slim`).
#
# Usage: deploy/images/build-base.sh [IMAGE]   (default: tutor/base:bookworm)
set -euo pipefail
image="${1:-tutor/base:bookworm}"
suite="${TUTOR_DEBIAN_SUITE:-bookworm}"
mirror="${TUTOR_DEBIAN_MIRROR:-}"

if docker image inspect "$image" >/dev/null 2>&1; then
  echo "$image exists"
  exit 0
fi
if ! command -v debootstrap >/dev/null; then
  echo "installing debootstrap (apt-get)"
  if [ "$(id -u)" -ne 0 ]; then
    echo "debootstrap is missing and this is not root: apt-get install debootstrap" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi
rootfs="$(mktemp -d /tmp/tutor-rootfs.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT
echo "debootstrap $suite into $rootfs (about a minute)"
debootstrap --variant=minbase --include=python3,python3-pytest,git,ca-certificates,procps \
  "$suite" "$rootfs" $mirror >/tmp/tutor-debootstrap.log 2>&1 || {
  echo "debootstrap failed; see /tmp/tutor-debootstrap.log" >&2
  tail -20 /tmp/tutor-debootstrap.log >&2
  exit 1
}
# Keep the image small: package caches and docs are not needed to run tests.
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc "$rootfs"/usr/share/man
tar -C "$rootfs" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' - "$image" >/dev/null
echo "built $image ($(docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1/1e6}'))"
