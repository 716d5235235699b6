"""Kubelet device plugins for VFIO passthrough GPUs and container GPUs."""
