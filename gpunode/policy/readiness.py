"""Readiness files other GPU Operator components wait on."""

from __future__ import annotations

from gpunode.host.files import remove_file, write_atomic
from gpunode.host.root import HostRoot
from gpunode.policy.workload import Workload

VALIDATIONS = "/run/nvidia/validations"
VFIO_READY = f"{VALIDATIONS}/vfio-pci-ready"
WORKLOAD_TYPE = f"{VALIDATIONS}/workload-type"


def mark_ready(host: HostRoot, workload: str = Workload.VM_PASSTHROUGH) -> list[str]:
    """Write the readiness files; return the host paths that changed."""
    changed = []
    if write_atomic(host.path(VFIO_READY), "true\n"):
        changed.append(VFIO_READY)
    if write_atomic(host.path(WORKLOAD_TYPE), workload + "\n"):
        changed.append(WORKLOAD_TYPE)
    return changed


def clear_ready(host: HostRoot) -> list[str]:
    return [p for p in (VFIO_READY, WORKLOAD_TYPE) if remove_file(host.path(p))]


def mark_workload(host: HostRoot, workload: str) -> list[str]:
    """A node that no longer runs VM passthrough: ``workload-type`` names the new
    workload and ``vfio-pci-ready`` goes; return the host paths that changed."""
    changed = [VFIO_READY] if remove_file(host.path(VFIO_READY)) else []
    if write_atomic(host.path(WORKLOAD_TYPE), workload + "\n"):
        changed.append(WORKLOAD_TYPE)
    return changed
