"""The offer gate: the node's runtime classes are offered (``pipeline.offers``) only while the
kubelet has our device plugin's devices to give, and taken off first when the agent stops.

What the kubelet does (k8s.io/kubernetes v1.35.4, pkg/kubelet/cm/devicemanager/manager.go):
admission (``Allocate`` -> ``devicesToAllocate``) fails a container asking for a device-plugin
resource with ``UnexpectedAdmissionError`` when that resource's plugin has not registered or
lists no healthy device. The kubelet's own view of what it can give is ``GetAllocatableDevices``
(``allDevices.Filter(healthyDevices)``), which PodResources v1 ``GetAllocatableResources``
answers (pkg/kubelet/apis/podresources/server_v1.go): a plugin whose stream ended has all its
devices marked Unhealthy at once (``PluginDisconnected`` -> ``markResourceUnhealthy``), and a
restarted kubelet has none until the plugin registers again (``readCheckpoint``). The Node's
``status.allocatable`` says the same only at the next node status update (``GetCapacity``, every
``nodeStatusUpdateFrequency``), so the gate asks PodResources, the kubelet's memory itself.

So a class is offered while the kubelet lists at least one of this node's passthrough units
(``passthrough.resource_units``, whose ID is the plugin's device ID) as allocatable; a node
with no unit of ours has nothing to wait for. A kubelet that cannot be asked (restarting: its
socket is made again) has nothing to give either. The verdict is asked again at each check,
and at once when ``agent.kubeletwatch`` hears the kubelet or one of our plugins restart. On stop (SIGTERM: a rolling update, the pod
deleted) the labels go first, then the agent waits, bounded, until the kubelet has taken the
pods bound before (its pod manager holds a pod from the moment it admits it: kubelet.go
``HandlePodAdditions`` adds it and admits it in one step, and PodResources ``List`` reads that
pod manager), and only then tells the plugin beside it that it may stop
(``gpunode.host.standdown``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gpunode.host import standdown
from gpunode.policy.passthrough import resource_units
from gpunode.services.podresources import kubelet_pods, offered_devices
from katamgr.agent.target import Target

log = logging.getLogger("katamgr.agent")

# After the labels are off: the scheduler's informer sees the change within a second, and a pod
# it bound before reaches the kubelet's pod manager within about as long (its API watch). The
# drain ends once the kubelet's pod list has not grown for SETTLE seconds, at most DRAIN.
SETTLE = 2.0
DRAIN = 10.0


class OfferGate:
    """Whether the node's ready classes may be offered now, and the stand-down on stop."""

    def __init__(self, target: Target, *, allocatable: Callable[[], tuple[frozenset[str], str | None]] | None = None,
                 pods: Callable[[], frozenset[tuple[str, str]] | None] | None = None,
                 settle: float = SETTLE, drain: float = DRAIN) -> None:
        self.target = target
        self.allocatable = allocatable or (lambda: offered_devices(target.host))
        self.pods = pods or (lambda: kubelet_pods(target.host))
        self.settle = settle
        self.drain_timeout = drain
        self.stopping = False
        self.open: bool | None = None  # the last verdict (None: not asked yet)
        self.why = ""
        # Called each time the gate opens (the first time too), and at each look while it stays
        # open: ``agent.rejected`` looks then.
        self.on_open: Callable[[], object] | None = None
        self.while_open: Callable[[], object] | None = None
        self.resources: set[str] = set()  # the passthrough resources of the last verdict's scan

    def verdict(self) -> tuple[bool, str]:
        """(open, why): whether the kubelet has our devices to give now."""
        if self.stopping:
            return False, "the agent is stopping, and its device plugin with it"
        t = self.target
        found = resource_units(t.host, t.scan(), t.naming) if t.binds else []
        units = {u.id.lower() for u in found}
        self.resources = {u.resource_name for u in found}
        if not units:
            return True, "no passthrough device of ours on this node to wait for"
        offered, unknown = self.allocatable()
        if unknown is not None:
            return False, f"the kubelet cannot say which devices it can give ({unknown})"
        if not units & offered:
            return False, ("the kubelet lists none of this node's passthrough devices as allocatable "
                           "(the device plugin has not registered, or lists none healthy)")
        return True, f"the kubelet can give {len(units & offered)} of this node's {len(units)} passthrough device(s)"

    def look(self) -> bool:
        """Ask again; True when the verdict changed (the labels must follow)."""
        was = self.open
        self.open, self.why = self.verdict()
        if was is not None and was != self.open:
            log.info("offer gate %s: %s", "open" if self.open else "closed", self.why)
        if self.open and was is not True and self.on_open is not None:
            self.on_open()
        elif self.open and self.while_open is not None:
            self.while_open()
        return was != self.open

    def drain(self, *, clock: Callable[[], float] = time.monotonic) -> list[str]:
        """After the labels are off: wait until the kubelet's pod list has not grown for
        ``settle`` seconds, at most ``drain_timeout``; the pods it took meanwhile."""
        start = clock()
        seen = self.pods()
        if seen is None:
            return []
        first, quiet_since = set(seen), clock()
        while clock() - start < self.drain_timeout and clock() - quiet_since < self.settle:
            time.sleep(min(0.2, self.settle))
            now = self.pods()
            if now is None:
                break
            if now - seen:
                quiet_since = clock()
            seen = seen | now
        return sorted(f"{ns}/{name}" for ns, name in seen - first)

    def stand_down(self, withdraw: Callable[[], object] | None) -> None:
        """On stop: the gate shut, the labels off (``withdraw``; None: there are none), the
        pods bound before taken by the kubelet, then the plugin told it may stop."""
        self.stopping = True
        self.open, self.why = self.verdict()
        taken = []
        if withdraw is not None:
            withdraw()
            taken = self.drain()
        if taken:
            log.info("the kubelet took %d pod(s) bound before the offers were withdrawn: %s",
                     len(taken), ", ".join(taken))
        standdown.tell_withdrawn(self.target.host)

