#!/usr/bin/env bash
# Makes the compose cluster's CA and certificates (once; rerun with --force to start over):
# a replica certificate for each of cp-1..cp-3, a node certificate for each simulated GPU
# host (its CN is the node name, which the control plane holds the agent to) and an admin
# client identity for gpuctl on the host.
# Usage: deploy/compose/make-certs.sh [--force] [--out DIR] [GPUCTL]
#   DIR defaults to deploy/compose/tls (ignored by git); docker-compose.yml reads
#   ${GPUCP_TLS_DIR:-./tls}. GPUCTL defaults to `gpuctl` on the PATH.
set -euo pipefail
force=""
out="$(cd "$(dirname "$0")" && pwd)/tls"
while [ $# -gt 0 ]; do
  case "$1" in
    --force) force=1; shift ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    -*) echo "make-certs.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
gpuctl="${1:-gpuctl}"
# The GPU hosts of docker-compose.yml.
nodes="gpu-h100 gpu-v100 gpu-a100 gpu-l40s"

if [ -n "$force" ]; then rm -rf "$out"; fi
mkdir -p "$out"
if [ ! -f "$out/ca/ca.pem" ]; then
  "$gpuctl" certs init --dir "$out/ca" --cluster compose >/dev/null
fi
for i in 1 2 3; do
  [ -f "$out/replica-$i/cert.pem" ] ||
    "$gpuctl" certs issue replica --ca-dir "$out/ca" --name "replica-$i" --out "$out/replica-$i" >/dev/null
done
for node in $nodes; do
  [ -f "$out/$node/cert.pem" ] ||
    "$gpuctl" certs issue node --ca-dir "$out/ca" --name "$node" --out "$out/$node" >/dev/null
done
[ -f "$out/admin/cert.pem" ] ||
  "$gpuctl" certs issue client --ca-dir "$out/ca" --name admin --role admin --out "$out/admin" >/dev/null
echo "certificates in $out; gpuctl on the host: GPUCTL_TLS_DIR=$out/admin"
