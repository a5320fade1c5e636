#!/bin/sh
# A Debian bookworm base image with python3, made without a container registry:
# debootstrap (minbase) from the Debian mirror apt already uses, then `podman import`.
#   deploy/local/base-image.sh [NAME]        (root; about a minute)
# deploy/Dockerfile builds on it with --build-arg BASE_IMAGE=NAME (default cachesvc-base:bookworm).
set -eu
name=${1:-cachesvc-base:bookworm}
mirror=${DEBIAN_MIRROR:-$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '$2 ~ /debian\/?$/ {print $2; exit}')}
mirror=${mirror:-$(awk '$1 == "deb" && $3 == "bookworm" {print $2; exit}' /etc/apt/sources.list 2>/dev/null)}
mirror=${mirror:-http://deb.debian.org/debian}
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv bookworm "$root" "$mirror" >&2
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | podman import --change 'CMD ["/bin/bash"]' - "$name"
