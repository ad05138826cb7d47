#!/usr/bin/env bash
# Builds the compose deployment's two images FROM scratch (nothing is pulled): each holds its
# binaries plus the shared libraries `ldd` says they need, at the same paths as on this host.
#   gpu-control-plane:TAG  control-plane and gpuctl                    (control-plane.Dockerfile)
#   gpu-node-agent:TAG     node-agent, gpucp-shim, /bin/sh, /bin/sleep,
#                          node-agent/topologies/*.txt                 (node-agent.Dockerfile)
# /bin/sh and /bin/sleep are this host's, so that simulated hosts' jobs have something to run.
#
# Usage: deploy/compose/build-image.sh [--debug] [--bin-dir DIR] [TAG]
#   (default: `cargo build --release`, TAG dev)
#   --debug        build and take the debug binaries instead
#   --bin-dir DIR  take the binaries from DIR (control-plane, gpuctl, node-agent and, when
#                  there, gpucp-shim) and do not run cargo
# Debug information is stripped from the copies (the images' symbol tables stay).
set -euo pipefail
cd "$(dirname "$0")/../.."
profile=release
bin_dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --debug) profile=debug; shift ;;
    --release) profile=release; shift ;;
    --bin-dir) bin_dir="$2"; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    -*) echo "build-image.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
tag="${1:-dev}"

if [ -z "$bin_dir" ]; then
  flags=()
  if [ "$profile" = release ]; then flags+=(--release); fi
  cargo build "${flags[@]}" -p control-plane -p node-agent --bins
  # Where cargo put them (CARGO_TARGET_DIR, build.target-dir or ./target).
  target_dir="$(cargo metadata --format-version 1 --no-deps |
    sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
  bin_dir="${target_dir:-target}/$profile"
fi
for bin in control-plane gpuctl node-agent; do
  if [ ! -x "$bin_dir/$bin" ]; then
    echo "build-image.sh: no $bin in $bin_dir" >&2
    exit 1
  fi
done

ctx="$(mktemp -d)"
trap 'rm -rf "$ctx"' EXIT

# copy SRC DEST ROOTFS: SRC into ROOTFS at DEST (debug information stripped), then every
# library it links (and the dynamic loader) at its own path.
copy() {
  local src="$1" dest="$2" rootfs="$3"
  mkdir -p "$rootfs$(dirname "$dest")"
  if ! strip --strip-debug -o "$rootfs$dest" "$src" 2>/dev/null; then
    cp -L "$src" "$rootfs$dest"
  fi
  chmod 755 "$rootfs$dest"
  # A static executable has nothing to list (and ldd says so, failing).
  { ldd "$src" 2>/dev/null || true; } | grep -o '/[^ ]*' | while read -r lib; do
    if [ ! -e "$rootfs$lib" ]; then
      mkdir -p "$rootfs$(dirname "$lib")"
      cp -L "$lib" "$rootfs$lib"
    fi
  done
}

# What both images need besides their programs: /tmp, and name lookups through the hosts
# file and DNS (Docker writes /etc/hosts and /etc/resolv.conf into each container).
base() {
  local rootfs="$1"
  mkdir -p "$rootfs/tmp" "$rootfs/etc"
  chmod 1777 "$rootfs/tmp"
  printf 'hosts: files dns\n' >"$rootfs/etc/nsswitch.conf"
}

cp_root="$ctx/control-plane/rootfs"
base "$cp_root"
mkdir -p "$cp_root/data"
for bin in control-plane gpuctl; do
  copy "$bin_dir/$bin" "/usr/local/bin/$bin" "$cp_root"
done
cp deploy/compose/control-plane.Dockerfile "$ctx/control-plane/Dockerfile"

agent_root="$ctx/node-agent/rootfs"
base "$agent_root"
mkdir -p "$agent_root/var/lib/gpu-node-agent" "$agent_root/usr/share/gpu-node-agent/topologies"
copy "$bin_dir/node-agent" /usr/local/bin/node-agent "$agent_root"
# The agent uses gpucp-shim beside it when it is there, else `node-agent shim`.
if [ -x "$bin_dir/gpucp-shim" ]; then
  copy "$bin_dir/gpucp-shim" /usr/local/bin/gpucp-shim "$agent_root"
fi
for prog in sh sleep; do
  copy "$(command -v "$prog")" "/bin/$prog" "$agent_root"
done
cp node-agent/topologies/*.txt "$agent_root/usr/share/gpu-node-agent/topologies/"
cp deploy/compose/node-agent.Dockerfile "$ctx/node-agent/Dockerfile"

for image in control-plane node-agent; do
  docker build -q -t "gpu-$image:$tag" "$ctx/$image" >/dev/null
  echo "built gpu-$image:$tag ($(du -sh "$ctx/$image/rootfs" | cut -f1))"
done
