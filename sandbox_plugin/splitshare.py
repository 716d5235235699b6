"""The split label as each plugin serves it: the passthrough plugin lists only the VM share, the
container plugin only the rest (``gpunode.policy.split``, the label
``nvidia.com/gpu.workload.vm-passthrough.gpus``, read by the same label watch as the workload).

Both act on the label itself, before katamgr moves a GPU, so a GPU changing side is withdrawn by
the side it leaves first: the kubelet stops offering it there, then katamgr moves its driver
(waiting for the kubelet where it can see it), then the side it joins offers it, once it is on
that side's driver. A passthrough unit a pod holds stays listed until that pod is gone (as the
held-only plugin of a node that left vm-passthrough), so a restarted kubelet keeps the pod; the
kubelet never gives a device a pod holds to another pod.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from gpunode.errors import ConfigError
from gpunode.host.root import HostRoot
from gpunode.policy.naming import Naming
from gpunode.policy.splitnode import node_split

log = logging.getLogger(__name__)

T = TypeVar("T")


class SplitShare:
    """The node's split as the plugins of this process serve it. ``vm`` is None where every GPU is
    the VM's (no split label); else the BDFs of the VM share, and ``container`` those of the rest
    (with the NVSwitches the split keeps on the host)."""

    def __init__(self, host: HostRoot, naming: Naming) -> None:
        self.host = host
        self.naming = naming  # the operator's selection, before the split
        self.value: str | None = None
        self.vm: frozenset[str] | None = None
        self.container: frozenset[str] = frozenset()
        self._lock = threading.Lock()
        self._refused: str | None = None

    def set(self, value: str | None) -> bool:
        """Serve the split ``value`` from now on; True when the shares changed. A bad value keeps
        the shares served (logged once: the agent records the Event)."""
        try:
            share = node_split(self.host, self.naming, value)
        except ConfigError as exc:
            if str(exc) != self._refused:
                log.warning("%s; keeping the split served", exc)
            self._refused = str(exc)
            return False
        self._refused = None
        vm = frozenset(d.bdf for d in share.vm) if share.is_split else None
        held_back = () if share.nvswitches_to_vm else share.nvswitches
        container = frozenset(d.bdf for d in (*share.container, *held_back)) if share.is_split else frozenset()
        with self._lock:
            changed = (vm, container) != (self.vm, self.container)
            self.value, self.vm, self.container = value, vm, container
        if changed:
            log.info("split %s", share.describe())
        return changed

    def passthrough_units(self, units: Sequence[T], bdfs_of: Callable[[T], Sequence[str]],
                          held: Callable[[T], bool]) -> list[T]:
        """The units the passthrough plugin lists: none with a device of the container share,
        unless a pod holds it (kept until that pod is gone)."""
        with self._lock:
            container = self.container
        return [u for u in units if not set(bdfs_of(u)) & container or held(u)]

    def container_gpus(self, gpus: Sequence[T], bdf_of: Callable[[T], str | None]) -> list[T]:
        """The GPUs the container plugin lists: none of the VM share."""
        with self._lock:
            vm = self.vm
        if vm is None:
            return list(gpus)
        return [g for g in gpus if bdf_of(g) not in vm]
