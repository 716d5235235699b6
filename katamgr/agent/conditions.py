"""The node's state as Node conditions, where Kubernetes users look (``kubectl describe
node``), in node-problem-detector's convention: each condition a ``type`` of ours with a
``status`` (True is the good state for every type here), a CamelCase ``reason`` and a
``message``; ``lastTransitionTime`` moves only when the status flips.

Read from the agent's own metrics, so a condition says what the alerts see. Written only
when a condition's status, reason or message changed (``lastHeartbeatTime`` is that write's
time, not a heartbeat): a node at rest costs no API request; after a failed write the next
try waits ``RETRY_AFTER`` seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from gpunode.errors import GpuNodeError
from gpunode.policy.health import HAND_BACK_FAILED
from katamgr.agent.metrics import AgentMetrics

log = logging.getLogger("katamgr.agent")

RUNTIME_CLASSES = "SandboxRuntimeClassesReady"
GPUS = "SandboxGPUsReady"
HEALTHY = "SandboxGPUHealthy"
FABRIC = "SandboxNVLinkFabricReady"
TYPES = (RUNTIME_CLASSES, GPUS, HEALTHY, FABRIC)
RETRY_AFTER = 300.0
_REASON = {"sharedNvswitch": "SharedNvswitch", "fullPassthrough": "FullPassthrough", "off": "FabricOff"}


@dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True", "False" or "Unknown", as the API spells them
    reason: str
    message: str


def _samples(metrics: AgentMetrics, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for family in metrics.registry.collect() for s in family.samples
            if s.name == name]


def _list(names: list[str]) -> str:
    return ", ".join(sorted(names))


def node_conditions(metrics: AgentMetrics, binds: bool) -> list[Condition]:
    """The conditions the agent's metrics say, each only where the agent knows it."""
    found = []
    classes = _samples(metrics, "katamgr_runtime_class_ready")
    if classes:
        failed = [labels["runtime_class"] for labels, value in classes if not value]
        if failed:
            found.append(Condition(RUNTIME_CLASSES, "False", "RuntimeClassFailed",
                                   f"runtime class(es) {_list(failed)} not installed or not registered with "
                                   "containerd, so not offered here (Events RuntimeClassFailed say why)"))
        else:
            found.append(Condition(RUNTIME_CLASSES, "True", "RuntimeClassesOffered",
                                   f"offered here: {_list([labels['runtime_class'] for labels, _ in classes])}"))
    devices = _samples(metrics, "katamgr_devices")
    if binds and devices:
        waiting = sum(int(v) for labels, v in devices if labels["action"] == "bind")
        kept = sum(int(v) for labels, v in devices if labels["action"] == "keep")
        if waiting:
            found.append(Condition(GPUS, "False", "GPUsNotBound",
                                   f"{waiting} device(s) the workload label asks for on vfio-pci are not "
                                   f"bound ({kept} are); see the Events ReconcileFailed"))
        else:
            found.append(Condition(GPUS, "True", "GPUsBound", f"{kept} device(s) on vfio-pci for VMs"))
    if binds:
        unfit = [labels["device"] for labels, v in _samples(metrics, "katamgr_gpu_unhealthy") if v]
        held = [labels["device"] for labels, v in _samples(metrics, "katamgr_gpu_handback_failed") if v]
        if unfit:
            found.append(Condition(HEALTHY, "False", "GPUUnhealthy",
                                   f"unfit for a VM and not offered: {_list(unfit)} (Events GpuUnhealthy say why)"))
        elif held:
            found.append(Condition(HEALTHY, "False", HAND_BACK_FAILED,
                                   f"held out after a failed hand-back check: {_list(held)}"))
        else:
            found.append(Condition(HEALTHY, "True", "GPUsHealthy", "no passthrough device is unfit for a VM"))
    model = next((labels["model"] for labels, v in _samples(metrics, "katamgr_nvlink_fabric_model") if v), None)
    if model == "none":
        found.append(Condition(FABRIC, "False", "NoFabricModel",
                               "neither NVIDIA's shared-NVSwitch nor full-passthrough model holds: the GPUs "
                               "are withheld (the agent's Events say which part is missing)"))
    elif model is not None:
        found.append(Condition(FABRIC, "True", _REASON[model], f"the NVSwitch board follows {model}"))
    return found


class NodeConditions:
    """Publishes conditions through ``write`` (a list of API-form conditions), remembering
    what it wrote; ``read`` gives what the Node holds (once, at the first publish, so an
    agent restart neither rewrites nor moves ``lastTransitionTime``)."""

    def __init__(self, write: Callable[[list[dict[str, str]]], None],
                 read: Callable[[], dict[str, dict[str, str]]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.write = write
        self.read = read
        self.clock = clock
        self.published: dict[str, dict[str, str]] | None = None
        self._not_before = 0.0

    def publish(self, conditions: list[Condition]) -> None:
        if self.clock() < self._not_before:
            return
        try:
            if self.published is None:
                self.published = dict(self.read()) if self.read is not None else {}
            now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            changed = []
            for c in conditions:
                old = self.published.get(c.type)
                if old is not None and (old.get("status"), old.get("reason"), old.get("message")) == (
                        c.status, c.reason, c.message):
                    continue
                moved = old is None or old.get("status") != c.status or not old.get("lastTransitionTime")
                changed.append({"type": c.type, "status": c.status, "reason": c.reason, "message": c.message,
                                "lastHeartbeatTime": now,
                                "lastTransitionTime": now if moved else old["lastTransitionTime"]})
            if changed:
                self.write(changed)
                self.published.update({c["type"]: c for c in changed})
        except GpuNodeError as exc:
            self._not_before = self.clock() + RETRY_AFTER
            log.warning("could not publish the node's conditions (retrying in %.0f s): %s", RETRY_AFTER, exc)
