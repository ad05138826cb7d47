#!/usr/bin/env bash
# Makes the compose cluster's CA and certificates in deploy/docker/tls/ (once; rerun with
# --force to start over): a replica certificate for each of cp-1..cp-3 and an admin client
# identity for gpuctl on the host. Usage: deploy/docker/make-certs.sh [--force] [GPUCTL]
set -euo pipefail
cd "$(dirname "$0")"
force=""
if [ "${1:-}" = "--force" ]; then force=1; shift; fi
gpuctl="${1:-gpuctl}"
if [ -n "$force" ]; then rm -rf tls; fi
if [ ! -f tls/ca/ca.pem ]; then
  "$gpuctl" certs init --dir tls/ca --cluster compose
fi
for i in 1 2 3; do
  [ -f "tls/replica-$i/cert.pem" ] ||
    "$gpuctl" certs issue replica --ca-dir tls/ca --name "replica-$i" --out "tls/replica-$i"
done
[ -f tls/admin/cert.pem ] ||
  "$gpuctl" certs issue client --ca-dir tls/ca --name admin --role admin --out tls/admin
echo "certificates in $(pwd)/tls; gpuctl on the host: GPUCTL_TLS_DIR=$(pwd)/tls/admin"
