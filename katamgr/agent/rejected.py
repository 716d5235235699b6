"""Pods the kubelet refused for our devices before the device plugin registered, named where an
operator looks (``katamgr run --rejected-pods event``; the chart's
``sandboxDevicePlugin.rejectedPods``).

What the kubelet does (k8s.io/kubernetes v1.35.4): a pod whose container asks for a device-plugin
resource that has no registered plugin or no healthy device fails admission in the device manager
(pkg/kubelet/cm/devicemanager/manager.go, ``Allocate``), and the kubelet's admission handler
(pkg/kubelet/lifecycle/predicate.go) ends it in phase Failed with reason
``UnexpectedAdmissionError``; it is never admitted again. A pod of a controller (Deployment, Job,
StatefulSet, ...) is replaced by its controller; a bare pod stays Failed. The offer gate keeps
the scheduler from binding new pods while the plugin is away, but a pod bound before a node
reboot is re-admitted by the restarted kubelet in its own order, possibly before our plugin has
registered (the open upstream problem: kubernetes#125579).

So each time the gate opens (the plugin's devices are listed again: after the agent's start, a
kubelet restart, a plugin restart), the agent lists its node's Failed pods and records one
Warning Event on the Node naming each pod refused for a resource of ours that it has not named
before, with the kubelet's message and the fix. The kubelet writes a refusal to the API server
through its status manager (pkg/kubelet/status/status_manager.go), which after a reboot may
still be catching up when the plugin registers: seen on the real node, a pod refused before the
plugin registered was not yet Failed in the API when the gate opened. So the list is made
again every AGAIN seconds while the gate stays open, for WINDOW seconds after it opened;
nothing is listed at rest. No pod is deleted or created: that would take a
right to create pods in every namespace, more than a node agent should hold.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from gpunode.errors import GpuNodeError
from katamgr.agent.events import NodeEvents

if TYPE_CHECKING:
    from katamgr.cluster.pods import FailedPod

log = logging.getLogger("katamgr.agent")

ADMISSION_ERROR = "UnexpectedAdmissionError"  # the kubelet's status.reason (lifecycle/predicate.go)
MODES = ("none", "event")
AGAIN = 5.0  # seconds between two lists after an opening
WINDOW = 60.0  # seconds after an opening the lists go on (the status manager's syncs are 10 s apart)


def refused_for(pods: Iterable[FailedPod], resources: set[str]) -> list[FailedPod]:
    """The Failed pods the kubelet refused at admission while asking for one of ``resources``."""
    return [p for p in pods if p.reason == ADMISSION_ERROR and set(p.resources) & resources]


def describe(pod: FailedPod, resources: set[str]) -> str:
    """One pod's line of the Event: who, what it asked, what the kubelet said, what to do."""
    asked = ", ".join(sorted(set(pod.resources) & resources))
    then = (f"its controller {pod.controller} replaces it" if pod.controller
            else "a bare pod stays Failed: delete it and create it again")
    return f"{pod.namespace}/{pod.name} (asked for {asked}; the kubelet: {pod.message or ADMISSION_ERROR}): {then}"


class RejectedPods:
    """Names each refused pod once, by UID, when asked (``look``)."""

    def __init__(self, failed_pods: Callable[[], list[FailedPod]], resources: Callable[[], set[str]],
                 events: NodeEvents, clock: Callable[[], float] = time.monotonic) -> None:
        self.failed_pods = failed_pods
        self.resources = resources
        self.events = events
        self.clock = clock
        self.named: set[str] = set()  # UIDs already in an Event
        self.opened_at: float | None = None  # the gate's last opening
        self.looked_at = 0.0

    def opened(self) -> list[str]:
        """The gate has just opened: look now, and again while it stays open (``still_open``)."""
        self.opened_at = self.looked_at = self.clock()
        return self.look()

    def still_open(self) -> list[str]:
        """The gate was asked again and is still open: look again every AGAIN seconds, within
        WINDOW seconds of its opening."""
        now = self.clock()
        if self.opened_at is None or now - self.opened_at > WINDOW or now - self.looked_at < AGAIN:
            return []
        self.looked_at = now
        return self.look()

    def look(self) -> list[str]:
        """List the node's Failed pods; record the newly refused ones. Their lines (empty: none
        new); a list the API server refused is logged and tried again at the next opening."""
        ours = self.resources()
        if not ours:
            return []
        try:
            pods = self.failed_pods()
        except GpuNodeError as exc:
            log.warning("could not look for pods the kubelet refused at admission: %s", exc)
            return []
        new = [p for p in refused_for(pods, ours) if p.uid not in self.named]
        if not new:
            return []
        self.named |= {p.uid for p in new}
        lines = [describe(p, ours) for p in new]
        log.warning("the kubelet refused %d pod(s) for this node's passthrough devices before the device "
                    "plugin registered: %s", len(new), "; ".join(lines))
        self.events.pods_refused(lines)
        return lines
