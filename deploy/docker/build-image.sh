#!/usr/bin/env bash
# Builds the `gpu-control-plane` image FROM scratch: the release binaries plus the shared
# libraries `ldd` says they need. Usage: deploy/docker/build-image.sh [TAG]
set -euo pipefail
cd "$(dirname "$0")/../.."
tag="${1:-gpu-control-plane:dev}"
cargo build --release -p control-plane --bins
ctx="$(mktemp -d)"
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/rootfs/usr/local/bin" "$ctx/rootfs/tmp" "$ctx/rootfs/data"
target="${CARGO_TARGET_DIR:-target}/release"
for bin in control-plane gpuctl; do
  cp "$target/$bin" "$ctx/rootfs/usr/local/bin/"
  # Copy each linked library (and the dynamic loader) to the same path inside the image.
  ldd "$target/$bin" | grep -o '/[^ ]*' | while read -r lib; do
    mkdir -p "$ctx/rootfs$(dirname "$lib")"
    cp -L "$lib" "$ctx/rootfs$lib"
  done
done
cp deploy/docker/Dockerfile "$ctx/"
docker build -t "$tag" "$ctx"
echo "built $tag"
