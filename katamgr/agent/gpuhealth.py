"""The passthrough GPUs' health as the host kernel sees it, and the hand-back between tenants.

Each check, for every selected device on vfio-pci (while the node binds them):

- its facts (``gpunode.host.pcihealth``: AER counts, link, config space, reset methods) are
  judged by the node's health policy (``gpunode.policy.health``), the device plugin's: a
  device turning unfit for as long as a fact lasts, or fit again, is an Event on the Node
  naming it and the reason, and a metric. New AER errors are an Event as they are counted
  (fatal and non-fatal a Warning); correctable ones only when more than
  ``CORRECTABLE_ALERT`` arrive between two checks (a rate, never a fault). Whether an AER
  error keeps a device out until it recovered is the plugins' to follow (they hear the
  kernel's recovery events);
- the kubelet's PodResources says which devices pods hold; one no pod holds any more, and
  no VM holds open, gets its hand-back check (``HealthPolicy.hand_back``: a reset through
  sysfs, read back sane under the same policy), whose verdict file
  (``gpunode.host.handback``) the device plugin and the DRA driver read. A device that
  fails stays out and is checked again at each check until it passes.
"""

from __future__ import annotations

import logging

from gpunode.host import handback, pcihealth
from gpunode.host.pcihealth import AerCounts
from gpunode.policy.health import (
    AER_CORRECTABLE,
    AER_FATAL,
    AER_NONFATAL,
    DEFAULT_LINK_POLICY,
    HealthPolicy,
)
from gpunode.services.podresources import assigned_functions, list_pod_devices
from katamgr.agent.events import NodeEvents
from katamgr.agent.metrics import AgentMetrics
from katamgr.agent.target import Target

log = logging.getLogger("katamgr.agent")

CORRECTABLE_ALERT = 100  # correctable errors between two checks worth an Event


class GpuHealth:
    def __init__(self, target: Target, metrics: AgentMetrics, events: NodeEvents, *,
                 link_policy: str = DEFAULT_LINK_POLICY) -> None:
        self.target = target
        self.metrics = metrics
        self.events = events
        self.policy = HealthPolicy(link_policy)  # the plugins' judge holds an equal one
        self._seen: dict[str, AerCounts | None] = {}  # counts at the last check, per BDF
        self._unfit: dict[str, str] = {}  # BDF -> reason code of its last non-AER problem ("" fit)
        self._given: set[str] | None = None  # BDFs pods held at the last check (None: not asked yet)
        self._pending: set[str] = set()  # released, their hand-back still to pass

    def follow(self) -> None:
        t = self.target
        if not t.binds:
            self._given = None
            return
        inv = t.scan()
        devices = {d.bdf: d for d in inv.devices if inv.selected(d) and d.on_vfio}
        for bdf in devices:
            self._judge(bdf)
        self._hand_back(inv, devices)

    def _judge(self, bdf: str) -> None:
        facts = pcihealth.read_health(self.target.host, bdf)
        before = self._seen.get(bdf, facts.aer)
        self._seen[bdf] = facts.aer
        found = self.policy.problems(facts, before)
        if facts.aer is not None:
            for severity, count in (("correctable", facts.aer.correctable), ("nonfatal", facts.aer.nonfatal),
                                    ("fatal", facts.aer.fatal)):
                self.metrics.aer_errors.labels(bdf, severity).set(count)
        for problem in found:
            if problem.reason in (AER_FATAL, AER_NONFATAL):
                self.events.gpu_aer(problem.message, warning=True)
            elif problem.reason == AER_CORRECTABLE and facts.aer and before and (
                    facts.aer.correctable - before.correctable > CORRECTABLE_ALERT):
                self.events.gpu_aer(f"{problem.message}: more than {CORRECTABLE_ALERT} since the last check",
                                    warning=False)
        lasting = self.policy.lasting(found)
        code = lasting.reason if lasting else ""
        if code != self._unfit.get(bdf, ""):
            self.metrics.gpu_health_transitions.labels(bdf, "Unhealthy" if code else "Healthy", code).inc()
            if lasting:
                self.events.gpu_unhealthy(lasting.message)
            else:
                self.events.gpu_healthy(f"{bdf} is fit for a VM again")
        self._unfit[bdf] = code
        self.metrics.gpu_unhealthy.labels(bdf).set(int(bool(code)))

    def _hand_back(self, inv, devices: dict) -> None:
        t = self.target
        asked = list_pod_devices(t.host)
        if asked.unknown is not None:
            log.debug("hand-back checks wait: %s", asked.unknown)
            return
        given = set(assigned_functions(t.host, inv, t.naming, asked.assignments))
        if self._given is not None:
            self._pending |= (self._given - given) & set(devices)
        self._given = given
        for bdf in sorted(self._pending - given):
            verdict = self.policy.hand_back(t.host, bdf, devices[bdf].iommu_group if bdf in devices else None)
            if verdict is None:
                continue  # its VM still holds it open
            handback.write_verdict(t.host, verdict)
            self.metrics.handbacks.labels("passed" if verdict.ok else "failed").inc()
            self.metrics.handback_seconds.observe(verdict.seconds)
            self.metrics.handback_failed.labels(bdf).set(int(not verdict.ok))
            if verdict.ok:
                self._pending.discard(bdf)
                self.events.gpu_handed_back(f"{bdf} passed its hand-back check ({verdict.reset}, read back sane)")
            else:
                self.events.gpu_hand_back_failed(f"{bdf} failed its hand-back check and stays out: {verdict.reason}")
        self._pending &= set(devices)
