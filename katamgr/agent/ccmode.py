"""The node's confidential-computing mode, kept as its label asks (NVIDIA's k8s-cc-manager's job).

The node label ``nvidia.com/cc.mode`` says which mode the GPUs should run (``on``, ``off``,
``devtools``, ``ppcie``); a node without it runs the chart's ``ccManager.defaultMode``, or
``off`` on a host whose KVM runs no confidential VMs (no SEV-SNP, no TDX: k8s-cc-manager
does the same). Only a vm-passthrough node is switched. A switch is the pipeline's
(``pipeline.ccmode``); while one is wanted but not done (a GPU is held: it waits, and says so
once in an Event) and while it runs, ``nvidia.com/cc.ready.state`` is ``false``, so the
scheduler puts no new confidential pod here. Afterwards ``nvidia.com/cc.mode.state`` is the
mode read back (or ``failed``) and ``nvidia.com/cc.ready.state`` follows it
(``gpunode.host.cc.ready_state``), but ``true`` only once the kubelet advertises the GPUs again
(the Node's allocatable count of each passthrough resource back to what the node has, and
the kubelet's PodResources listing each unit as allocatable, which the Node's status, synced
every 10 s, can be behind): the
device plugin marks them Unhealthy while they are unbound, and a pod the scheduler placed
before the kubelet heard they are back is refused by the kubelet ("cannot allocate unhealthy
devices", seen on the real kubelet by tests/node/test_node_cc.py). A failed switch is not
retried until the label changes (or the agent restarts). Each switch is a log line, an Event
and metric samples.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from gpunode.errors import GpuNodeError
from gpunode.host import cc
from gpunode.host.cc import CcMode
from gpunode.services.podresources import offered_devices
from katamgr.agent.events import NodeEvents
from katamgr.agent.health import Health
from katamgr.agent.metrics import AgentMetrics
from katamgr.agent.target import Target
from katamgr.pipeline import ccmode

log = logging.getLogger("katamgr.agent")  # the agent's one logger (see drift)


class CcModes:
    """Follows ``nvidia.com/cc.mode`` on a vm-passthrough node."""

    def __init__(self, target: Target, health: Health, metrics: AgentMetrics, events: NodeEvents, *,
                 default_mode: CcMode | None, read_labels: Callable[[], Mapping[str, str]] | None,
                 publish: Callable[[dict[str, str | None]], None] | None,
                 read_resources: Callable[[], tuple[Mapping[str, str], Mapping[str, str]]] | None = None) -> None:
        self.target = target
        self.health = health
        self.metrics = metrics
        self.events = events
        self.default_mode = default_mode  # None: not managed (no --cc-manager)
        self.read_labels = read_labels
        self.publish = publish
        # The Node's (capacity, allocatable): cc.ready.state waits for the GPUs to be advertised.
        self.read_resources = read_resources
        self.settled: str | None = None  # the wanted mode the node was last switched to (or found in)
        self.failed: str | None = None  # the wanted mode whose switch failed (not retried)
        self.last: ccmode.CcSwitchReport | None = None
        self._said: str | None = None  # the last problem logged, once

    @property
    def enabled(self) -> bool:
        return self.default_mode is not None

    def wanted(self, labels: Mapping[str, str]) -> tuple[CcMode, str]:
        value = labels.get(cc.MODE_LABEL, "")
        if value:
            return cc.parse_mode(value, f"node label {cc.MODE_LABEL}="), f"node label {cc.MODE_LABEL}={value}"
        assert self.default_mode is not None
        if self.default_mode is not CcMode.OFF and cc.host_cc(self.target.host) is None:
            return CcMode.OFF, (f"no {cc.MODE_LABEL} label and the host runs no confidential VMs (KVM has neither "
                                f"SEV-SNP nor TDX on), so off rather than the default {self.default_mode}")
        return self.default_mode, f"no {cc.MODE_LABEL} label: the default mode {self.default_mode}"

    def follow(self) -> bool:
        """Switch when the node's GPUs do not run the mode it asks for; True when a switch ran."""
        t = self.target
        if not self.enabled or not t.steps.passthrough:
            return False
        try:
            labels = dict(self.read_labels()) if self.read_labels is not None else {}
            wanted, why = self.wanted(labels)
        except (GpuNodeError, ValueError) as exc:
            self._say(f"cannot follow {cc.MODE_LABEL}: {exc}")
            return False
        if wanted.value in (self.settled, self.failed):
            self._publish_state(labels)
            return False
        return self._switch(wanted, why, labels)

    def _switch(self, wanted: CcMode, why: str, labels: Mapping[str, str]) -> bool:
        t = self.target

        labels = dict(labels)  # as the Node will read after our own writes

        def not_ready() -> None:
            # No new confidential pod lands here until the GPUs run the mode read back.
            if labels.get(cc.READY_STATE_LABEL) not in (None, "false") and self.publish is not None:
                self._label({cc.READY_STATE_LABEL: "false"})
                labels[cc.READY_STATE_LABEL] = "false"

        with self.health.busy("switching the CC mode"):
            try:
                report = ccmode.switch(t.host, t.naming, wanted, lock_wait=0, before=not_ready)
            except GpuNodeError as exc:  # a busy node lock: the next check
                self._say(f"could not switch the CC mode to {wanted} yet ({exc}); trying again")
                return False
        if report.unverified and not report.waiting:
            # Every GPU it could read runs the wanted mode; the rest a VM or pod holds, and
            # only a reset (never done to a held GPU) changes a mode.
            if labels.get(cc.MODE_STATE_LABEL) == wanted.value:
                self.settled, self.failed = wanted.value, None
                return False
            report.held = dict(report.unverified)
            report.warnings.append(
                f"switching to CC mode {wanted} waits: the mode of " + "; ".join(
                    f"{b} (held by {w})" for b, w in sorted(report.unverified.items()))
                + " cannot be read while held (NVIDIA's tool maps the GPU's registers)")
        self.last = report
        if report.waiting:
            not_ready()
            self._say(report.warnings[0])
            self.events.cc_waiting(report.warnings[0])
            return False
        if report.state == cc.FAILED:
            self.failed, self.settled = wanted.value, None
            summary = (f"CC mode switch to {wanted} ({why}) failed: {'; '.join(report.failures)}; the GPUs are "
                       f"bound for passthrough as before, and {cc.MODE_STATE_LABEL}={cc.FAILED}")
            log.error("%s", summary)
            self.events.cc_switched(summary, failed=True)
        else:
            self.settled, self.failed = wanted.value, None
            if report.switched:
                summary = (f"CC mode switched to {report.state} ({why}): {', '.join(report.switched)} reset in one "
                           f"batch, read back and bound back for passthrough in {report.seconds:.1f} s")
                log.info("%s", summary)
                self.events.cc_switched(summary, failed=False)
            else:
                log.info("the GPUs run CC mode %s as wanted (%s)", report.state, why)
        if report.switched or report.state == cc.FAILED:
            result = "failure" if report.state == cc.FAILED else "success"
            self.metrics.cc_switches.labels(wanted.value, result).inc()
            self.metrics.cc_switch_seconds.observe(report.seconds)
        self.metrics.observe_cc_state(report.state)
        self._publish_state(labels, report.state)
        return bool(report.switched)

    def _publish_state(self, labels: Mapping[str, str], state: str | None = None) -> None:
        state = state or (self.last.state if self.last is not None else None)
        if not state or self.publish is None:
            return
        wanted = {cc.MODE_STATE_LABEL: state, cc.READY_STATE_LABEL: cc.ready_state(state)}
        if wanted[cc.READY_STATE_LABEL] == "true" and not self._advertised():
            wanted[cc.READY_STATE_LABEL] = "false"  # looked at again at the next check
        if any(labels.get(k) != v for k, v in wanted.items()):
            self._label(wanted)

    def _advertised(self) -> bool:
        """Whether the kubelet advertises every passthrough unit of the node again: each device
        plugin resource the Node has capacity of is allocatable in full, and the kubelet's
        PodResources lists each of its units as allocatable now. A resource the Node does not
        list (the DRA driver publishes instead, or the plugin is off) is not waited for."""
        if self.read_resources is None:
            return True
        from gpunode.policy.passthrough import resource_units

        t = self.target
        expected: dict[str, int] = {}
        units = resource_units(t.host, t.scan(), t.naming)
        for unit in units:
            expected[unit.resource_name] = expected.get(unit.resource_name, 0) + 1
        try:
            capacity, allocatable = self.read_resources()
        except GpuNodeError as exc:
            self._say(f"cannot read the Node's allocatable resources ({exc}); cc.ready.state waits")
            return False
        short = {name: allocatable.get(name, "0") for name, count in expected.items()
                 if name in capacity and allocatable.get(name, "0") != str(count)}
        if short:
            self._say("cc.ready.state stays false until the kubelet advertises the GPUs again: allocatable "
                      + ", ".join(f"{n}={v} of {expected[n]}" for n, v in sorted(short.items())))
            return False
        # The Node's allocatable is the kubelet's report at its last status sync (every 10 s):
        # a switch shorter than that can leave it whole from before the GPUs went Unhealthy.
        # PodResources answers from the kubelet's device manager as it is now (only for a
        # kubelet that can be asked, and for the resources the Node lists).
        offered, unknown = offered_devices(t.host)
        missing = sorted(u.id for u in units if u.resource_name in capacity
                         and u.id not in offered) if unknown is None else []
        if missing:
            self._say("cc.ready.state stays false until the kubelet offers the GPUs again: "
                      f"its PodResources does not list {', '.join(missing)} as allocatable")
            return False
        return True

    def _label(self, labels: dict[str, str | None]) -> None:
        try:
            self.publish(labels)  # type: ignore[misc]
        except GpuNodeError as exc:
            self._say(f"could not label the node ({exc}); trying again at the next check")

    def _say(self, message: str) -> None:
        if message != self._said:
            log.warning("%s", message)
        self._said = message
