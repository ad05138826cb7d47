#!/usr/bin/env bash
# The checks that need a real NVIDIA GPU, in one run: what the driver says, NVML discovery
# and per-process sampling through the agent's own code, and an allocation's cgroup letting a
# process open its own GPU's device node and not another's (node-agent/tests/real_gpu.rs).
# Run as root from the repository root on a GPU host; everything printed goes to $OUT (or
# ./gpu-check-out) as well as the terminal.
set -uo pipefail
out="${OUT:-./gpu-check-out}"
mkdir -p "$out"
{
    echo "== nvidia-smi"; nvidia-smi || true
    echo "== nvidia-smi -L"; nvidia-smi -L || true
    echo "== nvidia-smi topo -m"; nvidia-smi topo -m || true
    echo "== /proc/devices (NVIDIA)"; grep -i nvidia /proc/devices || true
    echo "== mig-minors"; head -20 /proc/driver/nvidia-caps/mig-minors 2>/dev/null || echo none
    echo "== cgroup mounts"; grep cgroup /proc/self/mountinfo || true
} 2>&1 | tee "$out/driver.txt"
GPUCP_REAL_GPU=1 cargo test -p node-agent --test real_gpu -- --nocapture --test-threads 1 \
    2>&1 | tee "$out/real_gpu_tests.txt"
exit "${PIPESTATUS[0]}"
