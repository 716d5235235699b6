"""A split node as each plugin serves it: the passthrough plugin lists only the VM side, the
container plugin only the container side (``gpunode.policy.split``; the label
``nvidia.com/gpu.workload.vm-passthrough.gpus``).

Both read the sides katamgr publishes as it carries the split out (``splitnode.SIDES_FILE``), not
the label: a GPU changing side is on neither while it moves. katamgr takes it off the side it
leaves, waits until the kubelet no longer offers it there, moves its driver, and only then puts
it on the side it joins, so no GPU is ever offered by both plugins, however late either plugin
sees a change. A passthrough unit a pod holds stays listed until that pod is gone (as the
held-only plugin of a node that left vm-passthrough), so a restarted kubelet keeps the pod.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from gpunode.host.root import HostRoot
from gpunode.policy.splitnode import read_sides

log = logging.getLogger(__name__)

T = TypeVar("T")


class SplitShare:
    """The sides as last read. ``vm`` is None where no split is carried out (every GPU is the
    node's workload's, as before splits); else the BDFs on the VM side, and ``container``
    those on the container side."""

    def __init__(self, host: HostRoot) -> None:
        self.host = host
        self.vm: frozenset[str] | None = None
        self.container: frozenset[str] = frozenset()
        self._lock = threading.Lock()

    def reload(self) -> bool:
        """Read the published sides again; True when they changed."""
        sides = read_sides(self.host)
        vm, container = sides if sides is not None else (None, frozenset())
        with self._lock:
            changed = (vm, container) != (self.vm, self.container)
            self.vm, self.container = vm, container
        if changed:
            log.info("split sides: VMs %s; containers %s", ", ".join(sorted(vm)) or "none" if vm is not None
                     else "every GPU (no split)", ", ".join(sorted(container)) or "none")
        return changed

    @property
    def split(self) -> bool:
        return self.vm is not None

    def passthrough_units(self, units: Sequence[T], bdfs_of: Callable[[T], Sequence[str]],
                          held: Callable[[T], bool], on_vfio: Callable[[T], bool]) -> list[T]:
        """The units the passthrough plugin lists: on a split node only those wholly on the VM side
        and on vfio-pci, and any a pod holds (kept until that pod is gone)."""
        with self._lock:
            vm = self.vm
        if vm is None:
            return list(units)
        return [u for u in units if (set(bdfs_of(u)) <= vm and on_vfio(u)) or held(u)]

    def container_gpus(self, gpus: Sequence[T], bdf_of: Callable[[T], str | None]) -> list[T]:
        """The GPUs the container plugin lists: on a split node only those on the container side."""
        with self._lock:
            vm, container = self.vm, self.container
        if vm is None:
            return list(gpus)
        return [g for g in gpus if bdf_of(g) in container]
