"""The Events the agent records on its Node: every reason it uses is here."""

from __future__ import annotations

from gpunode.kataclasses import offer_label
from gpunode.policy.inventory import Inventory
from katamgr.pipeline.report import Report

_ONCE_PER_ACTION = frozenset({"WorkloadSwitched", "OptOutsChanged", "GpusGivenBack", "WorkloadLabelInvalid",
                              "CcModeSwitched", "CcModeSwitchFailed", "GpuUnhealthy", "GpuHealthy",
                              "GpuAerErrors", "GpuHandBackChecked", "GpuHandBackFailed",
                              "PodRefusedAtAdmission"})


class NodeEvents:
    """Events through a ``katamgr.cluster.EventRecorder`` (which de-duplicates and
    rate-limits them), or none without a cluster and a node name."""

    def __init__(self, recorder=None) -> None:
        self.recorder = recorder

    def _record(self, reason: str, message: str, type_: str = "Normal") -> None:
        if self.recorder is not None:
            # A reconcile or a CDI sync may fail the same way every check: those are
            # rate-limited. What follows an operator's action (a relabel, a VM's end) is
            # bounded by those actions, and is what an operator looks for: never dropped.
            self.recorder.record(reason, message, type_, limited=reason not in _ONCE_PER_ACTION)

    def reconciled(self, report: Report, failed_before: bool) -> None:
        if report.failures:
            self._record("ReconcileFailed", "; ".join(report.failures), "Warning")
        for name, why in sorted(report.classes_failed.items()):
            # One Event per class, so `kubectl get events --field-selector reason=RuntimeClassFailed` names each.
            self._record("RuntimeClassFailed", f"{why}; RuntimeClass {name} is not offered on this node "
                                                "until it is installed", "Warning")
        for name, on in sorted(report.offered.items()):
            # Of their own too: a first reconcile's long Reconciled message is cut at 1 KiB.
            if on:
                self._record("RuntimeClassOffered", f"RuntimeClass {name} is offered on this node "
                                                    f"({offer_label(name)}=true): installed and registered "
                                                    "with containerd")
            else:
                self._record("RuntimeClassNotOffered", f"RuntimeClass {name} is no longer offered on this "
                                                       f"node (removed {offer_label(name)})")
        if report.changes:
            self._record("Reconciled", "; ".join(report.changes))
        elif report.ok and failed_before:
            self._record("Reconciled", "the node is as planned again after a failed reconcile")

    def offers_gated(self, report: Report, why: str) -> None:
        """The offer labels changed between reconciles, because of the offer gate (``why``)."""
        for name, on in sorted(report.offered.items()):
            self._record("RuntimeClassOffered" if on else "RuntimeClassNotOffered",
                         f"RuntimeClass {name} is {'offered' if on else 'no longer offered'} on this node "
                         f"({offer_label(name)}{'=true' if on else ' removed'}): {why}")
        if report.failures:
            self._record("ReconcileFailed", "; ".join(report.failures), "Warning")

    def cdi_specs_synced(self, report: Report) -> None:
        if report.failures:
            self._record("CdiSpecsFailed", "; ".join(report.failures), "Warning")
        if report.changes:
            self._record("CdiSpecsUpdated", "; ".join(report.changes))

    def given_back(self, message: str) -> None:
        """GPUs a switch kept for their VMs or pods, given back once those were gone."""
        self._record("GpusGivenBack", message)

    def pods_refused(self, lines: list[str]) -> None:
        """Pods the kubelet refused for our devices before the plugin registered (``rejected``):
        one Event each, so that none is cut off at the Event's 1 KiB."""
        for line in lines:
            self._record("PodRefusedAtAdmission", f"The kubelet refused pod {line}", "Warning")

    def label_refused(self, message: str) -> None:
        """The workload label names no workload: nothing moves until it does."""
        self._record("WorkloadLabelInvalid", message, "Warning")

    def switched(self, workload_changed: bool, summary: str) -> None:
        """A workload switch, or (the workload unchanged) a change of the opt-outs."""
        self._record("WorkloadSwitched" if workload_changed else "OptOutsChanged", summary)

    def cc_waiting(self, message: str) -> None:
        """A CC mode switch waits for held GPUs (recorded once per message)."""
        self._record("CcModeSwitchWaiting", message)

    def cc_switched(self, summary: str, *, failed: bool) -> None:
        self._record("CcModeSwitchFailed" if failed else "CcModeSwitched", summary,
                     "Warning" if failed else "Normal")

    def gpu_labels(self, report: Report) -> None:
        """The GPU labels set, or left to another writer (GFD, NFD) that set them otherwise."""
        if report.changes:
            self._record("GpuLabelsSet", "; ".join(report.changes))
        if report.warnings:
            self._record("GpuLabelsLeft", "; ".join(report.warnings), "Warning")
        if report.failures:
            self._record("GpuLabelsFailed", "; ".join(report.failures), "Warning")

    def nvlink_fabric(self, problem: str) -> None:
        """Neither of NVIDIA's models holds on this NVSwitch board (docs/devices.md, "NVLink fabric")."""
        self._record("NVLinkFabricUnavailable", problem, "Warning")

    def gpu_unhealthy(self, message: str) -> None:
        """A passthrough GPU the host kernel shows unfit for a VM (off the bus, its link, no reset)."""
        self._record("GpuUnhealthy", message, "Warning")

    def gpu_healthy(self, message: str) -> None:
        self._record("GpuHealthy", message)

    def gpu_aer(self, message: str, *, warning: bool) -> None:
        """New AER errors the kernel counted for a GPU (correctable ones only past a rate)."""
        self._record("GpuAerErrors" if warning else "GpuAerCorrectable", message, "Warning" if warning else "Normal")

    def gpu_handed_back(self, message: str) -> None:
        self._record("GpuHandBackChecked", message)

    def gpu_hand_back_failed(self, message: str) -> None:
        self._record("GpuHandBackFailed", message, "Warning")

    def artifacts_unverified(self, problems: list[str]) -> None:
        """The node's Kata artifacts failed verification (``kata_verify``): the agent stays
        unready and a DaemonSet rollout waits on this node. /readyz says why, but the kubelet's
        "Readiness probe failed" Event carries only the HTTP status (pkg/probe/http keeps the
        body out of it), so the class and what to do are said here, where kubectl shows them."""
        self._record("KataArtifactsUnverified", "the node's Kata artifacts failed verification, so this "
                     "agent is not Ready and a rollout of the agent waits on this node: " + "; ".join(problems),
                     "Warning")

    def kata_changed(self, message: str) -> None:
        """The node's Kata installed, upgraded or removed while the agent ran."""
        self._record("KataChanged", message)

    def nvswitches(self, inv: Inventory, kata_warning: str = "") -> None:
        """What the node does with its NVSwitches, where its Kata cannot cold-plug them:
        kept on the host (``--nvswitches auto``), or passed through at the operator's word;
        ``kata_warning``: why a typed Kata release is not the one found (the node's context)."""
        rule, setting = inv.nvswitch_rule, inv.selection.nvswitches
        held = [d.bdf for d in inv.devices
                if d.is_nvswitch and not inv.selected(d) and not inv.verdict(d).excluded]
        if held and setting == "auto":
            self._record("NVSwitchesNotPassedThrough",
                         f"NVSwitches {', '.join(held)} stay on their drivers: {rule.nvswitch_held_back}")
        if inv.nvswitches and rule.nvswitch_warning(setting):
            self._record("NVSwitchesFailKata", rule.nvswitch_warning(setting), "Warning")
        if kata_warning:
            # devices.kataVersion typed by hand, and not the release of the node's Kata runtimes.
            self._record("KataVersionDisagrees", kata_warning, "Warning")
