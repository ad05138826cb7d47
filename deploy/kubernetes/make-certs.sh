#!/usr/bin/env bash
# Issues the cluster's certificates with gpuctl and lays them out as the deployment uses them:
#   OUT/ca/                 the CA (ca-key.pem signs everything: keep it offline, not in Kubernetes)
#   OUT/gpucp-replica-tls/  the replicas' Secret: ca.pem, replica-<id>.cert.pem, replica-<id>.key.pem
#   OUT/gpucp-admin-tls/    an admin client identity for gpuctl: ca.pem, cert.pem, key.pem
#   OUT/nodes/<node>/       each GPU node's identity, to install as /etc/gpu-node-agent/tls on it
# Existing files are kept (rerun to add nodes). With --apply it then creates or updates the two
# Secrets with kubectl; without, it prints the kubectl commands.
#
# Usage: deploy/kubernetes/make-certs.sh [--out DIR] [--gpuctl PATH] [--namespace NS]
#          [--cluster NAME] [--replicas N] [--apply] [NODE...]
#   --out DIR       where the files go (default deploy/kubernetes/pki, which git ignores)
#   --gpuctl PATH   the gpuctl to run (default: gpuctl on PATH)
#   --namespace NS  namespace of the Secrets (default gpucp)
#   --cluster NAME  cluster name written into a new CA (default gpucp)
#   --replicas N    replica certificates replica-1..replica-N (default 3)
#   NODE...         Kubernetes node names (`kubectl get nodes -l nvidia.com/gpu.present=true`)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$here/pki"
gpuctl=gpuctl
namespace=gpucp
cluster=gpucp
replicas=3
apply=""
nodes=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --gpuctl) gpuctl="$2"; shift 2 ;;
    --namespace) namespace="$2"; shift 2 ;;
    --cluster) cluster="$2"; shift 2 ;;
    --replicas) replicas="$2"; shift 2 ;;
    --apply) apply=1; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    -*) echo "make-certs.sh: unknown option $1" >&2; exit 2 ;;
    *) nodes+=("$1"); shift ;;
  esac
done

if [ ! -f "$out/ca/ca.pem" ]; then
  "$gpuctl" certs init --dir "$out/ca" --cluster "$cluster" >/dev/null
fi
# issue KIND NAME DIR [FLAGS...]: one identity, unless DIR already has one.
issue() {
  local kind="$1" name="$2" dir="$3"
  shift 3
  if [ ! -f "$dir/cert.pem" ]; then
    "$gpuctl" certs issue "$kind" --ca-dir "$out/ca" --name "$name" --out "$dir" "$@" >/dev/null
  fi
}

secret="$out/gpucp-replica-tls"
mkdir -p "$secret"
for i in $(seq 1 "$replicas"); do
  issue replica "replica-$i" "$out/issued/replica-$i"
  cp "$out/issued/replica-$i/cert.pem" "$secret/replica-$i.cert.pem"
  cp "$out/issued/replica-$i/key.pem" "$secret/replica-$i.key.pem"
done
cp "$out/issued/replica-1/ca.pem" "$secret/ca.pem"
if [ -f "$out/ca/crl.pem" ]; then
  cp "$out/ca/crl.pem" "$secret/crl.pem"
fi

issue client admin "$out/gpucp-admin-tls" --role admin

for node in "${nodes[@]+"${nodes[@]}"}"; do
  issue node "$node" "$out/nodes/$node"
done

commands=(
  "kubectl -n $namespace create secret generic gpucp-replica-tls --from-file=$secret --dry-run=client -o yaml | kubectl apply -f -"
  "kubectl -n $namespace create secret generic gpucp-admin-tls --from-file=$out/gpucp-admin-tls --dry-run=client -o yaml | kubectl apply -f -"
)
if [ -n "$apply" ]; then
  for c in "${commands[@]}"; do
    bash -c "set -o pipefail; $c"
  done
else
  echo "certificates in $out; create the Secrets with:"
  printf '  %s\n' "${commands[@]}"
fi
if [ "${#nodes[@]}" -gt 0 ]; then
  echo "install each $out/nodes/<node>/ as /etc/gpu-node-agent/tls on that node (mode 0700, root)"
fi
