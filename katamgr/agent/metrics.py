"""The agent's Prometheus metrics (``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpunode.policy import health
from gpunode.policy.workload import Operand
from katamgr.pipeline.plan import Plan


class AgentMetrics:
    """The agent's Prometheus metrics, in a registry of its own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.reconcile_seconds = Histogram(
            "katamgr_reconcile_duration_seconds", "How long a reconcile took.", ["result"], registry=r,
            buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800))
        self.reconciles = Counter("katamgr_reconciles", "Reconciles run, by result.", ["result"], registry=r)
        self.reconcile_errors = Counter("katamgr_reconcile_errors", "Failures reported by reconciles.", registry=r)
        self.last_success = Gauge("katamgr_last_successful_reconcile_timestamp_seconds",
                                  "Unix time of the last reconcile that succeeded.", registry=r)
        self.retry_delay = Gauge("katamgr_reconcile_retry_delay_seconds",
                                 "Backoff before the next retry of a failed reconcile (0: none pending).",
                                 registry=r)
        self.devices = Gauge("katamgr_devices", "NVIDIA devices on the node by kind, driver and planned action.",
                             ["kind", "driver", "action"], registry=r)
        self.groups_skipped = Gauge("katamgr_iommu_groups_skipped", "IOMMU groups left alone, by reason.",
                                    ["reason"], registry=r)
        self.artifact_bytes = Counter("katamgr_artifact_pulled_bytes", "Kata artifact blob bytes pulled.",
                                      registry=r)
        self.cdi_syncs = Counter("katamgr_cdi_spec_syncs", "CDI spec rewrites after the devices changed.",
                                 registry=r)
        self.workload_switches = Counter("katamgr_workload_switches",
                                         "Switches of the node's workload after a relabel, by from and to.",
                                         ["from", "to"], registry=r)
        self.opted_out = Gauge("katamgr_opted_out",
                               "1 for each GPU Operator operand the node opts out of "
                               "(nvidia.com/gpu.deploy.<operand>=false).", ["operand"], registry=r)

        self.runtime_class_ready = Gauge(
            "katamgr_runtime_class_ready",
            "1 for each runtime class installed, registered with containerd and offered on this node; "
            "0 for one that failed (the Event RuntimeClassFailed and /readyz say why).",
            ["runtime_class"], registry=r)

        self.cc_switches = Counter("katamgr_cc_mode_switches",
                                   "CC mode switches of the node's GPUs, by wanted mode and result.",
                                   ["mode", "result"], registry=r)
        self.cc_switch_seconds = Histogram("katamgr_cc_mode_switch_duration_seconds",
                                           "How long a CC mode switch took (unbind, stage, reset, read back, "
                                           "bind back).", registry=r, buckets=(0.5, 1, 5, 10, 30, 60, 120, 300, 600))
        self.nvlink_model = Gauge("katamgr_nvlink_fabric_model",
                                  "1 for the NVLink fabric model an NVSwitch board follows (sharedNvswitch, "
                                  "fullPassthrough, off; none: neither holds).", ["model"], registry=r)
        self.cc_state = Gauge("katamgr_cc_mode_state",
                              "1 for the node's CC mode state as last read (on, off, devtools, ppcie, failed).",
                              ["state"], registry=r)

        self.aer_errors = Gauge("katamgr_gpu_aer_errors",
                                "AER errors the host kernel counted for a passthrough device since boot "
                                "(aer_dev_*'s TOTAL_ERR_*), by severity.", ["device", "severity"], registry=r)
        self.gpu_health_transitions = Counter(
            "katamgr_gpu_health_transitions",
            "A passthrough device turning unfit for a VM (by reason: "
            f"{', '.join(health.codes(health.LASTING))}) or fit again.", ["device", "health", "reason"], registry=r)
        self.handbacks = Counter("katamgr_gpu_handbacks",
                                 "Hand-back checks between tenants (reset, read back sane), by result.",
                                 ["result"], registry=r)
        self.handback_seconds = Histogram("katamgr_gpu_handback_duration_seconds",
                                          "How long one GPU's hand-back check took.", registry=r,
                                          buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        # Gauges of the state now, beside the transition counters: an alert on "unfit now"
        # must not depend on both transitions having been scraped since the agent started.
        self.gpu_unhealthy = Gauge("katamgr_gpu_unhealthy",
                                   "1 while a passthrough device is unfit for a VM (the Event GPUUnhealthy "
                                   "says why), 0 once fit again.", ["device"], registry=r)
        self.handback_failed = Gauge("katamgr_gpu_handback_failed",
                                     "1 while a device given back by its pod failed its hand-back check and "
                                     "is held out of the next tenant's reach, 0 once it passed.", ["device"],
                                     registry=r)
        self.workload_switch_seconds = Histogram(
            "katamgr_workload_switch_duration_seconds",
            "How long a switch of the node's workload after a relabel took (give back, bind, reconcile), "
            "by the workload switched to.", ["to"], registry=r,
            buckets=(1, 5, 10, 30, 60, 120, 300, 600, 1800))

    def observe_cc_state(self, state: str) -> None:
        for known in ("off", "on", "devtools", "ppcie", "failed"):
            self.cc_state.labels(known).set(int(known == state))

    def observe_nvlink_model(self, model: str | None) -> None:
        for name in ("sharedNvswitch", "fullPassthrough", "off", "none"):
            self.nvlink_model.labels(name).set(1 if (model or "none") == name else 0)

    def observe_plan(self, plan: Plan) -> None:
        counts: dict[tuple[str, str, str], int] = {}
        for d in plan.devices:
            key = (d.kind, d.driver or "none", d.action)
            counts[key] = counts.get(key, 0) + 1
        self.devices.clear()
        for key, n in counts.items():
            self.devices.labels(*key).set(n)
        skipped: dict[str, int] = {}
        for decision in plan.decisions:
            if decision.action.value == "skip":
                code = str(decision.skipped_because or "other")
                skipped[code] = skipped.get(code, 0) + 1
        self.groups_skipped.clear()
        for code, n in skipped.items():
            self.groups_skipped.labels(code).set(n)

    def observe_classes(self, configured: list[str], ready: list[str] | None) -> None:
        """Each configured runtime class's state after a reconcile (``ready`` None: not known, kept)."""
        if ready is None:
            return
        self.runtime_class_ready.clear()  # a class dropped from the config leaves no sample
        for name in configured:
            self.runtime_class_ready.labels(name).set(int(name in ready))

    def observe_opt_outs(self, out: frozenset[Operand]) -> None:
        # Every operand gets a sample, so a lifted opt-out reads 0 rather than vanishing.
        for operand in Operand:
            self.opted_out.labels(operand.value).set(int(operand in out))
