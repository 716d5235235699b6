#!/usr/bin/env bash
# Choose what a GPU node runs: Kata VMs with whole GPUs passed through (vm-passthrough)
# or ordinary GPU containers (container).
#
#   examples/label-node.sh <node> [vm-passthrough|container]
#
# The sandbox agent (katamgr and the passthrough device plugin) runs on every GPU node and
# follows the label live: on a vm-passthrough node it binds the GPUs to vfio-pci and
# advertises them, on a container node it gives them back and advertises nothing. The
# container device plugin runs on container nodes only. Nodes without the label run
# sandboxWorkloads.defaultWorkload. (vm-vgpu, NVIDIA vGPU, is not served by this chart.)
set -euo pipefail

node="${1:?usage: $0 <node> [vm-passthrough|container]}"
workload="${2:-vm-passthrough}"
case "$workload" in
  vm-passthrough|container) ;;
  *) echo "unknown workload '$workload': use vm-passthrough or container" >&2; exit 2 ;;
esac

# The GPU Operator (through Node Feature Discovery) sets nvidia.com/gpu.present on GPU
# nodes; without it, set it here so the DaemonSets schedule.
if [ -z "$(kubectl get node "$node" -o jsonpath='{.metadata.labels.nvidia\.com/gpu\.present}')" ]; then
  kubectl label node "$node" nvidia.com/gpu.present=true
fi

kubectl label node "$node" nvidia.com/gpu.workload.config="$workload" --overwrite
