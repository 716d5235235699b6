"""The workload switch: the node's labels changed, and so does what katamgr does on it.

The labels are the workload (``nvidia.com/gpu.workload.config``) and the GPU Operator's
opt-outs (``nvidia.com/gpu.deploy.<operand>=false``, ``gpunode.policy.workload.Operand``).
``vm-passthrough`` -> ``container`` (or opting out of ``vfio-manager``) gives the GPUs
no pod or VM holds back to their drivers, leaves the held ones on vfio-pci (reported,
and given back once they are free: ``giveback``), and makes the CDI specs and readiness
files follow; the Kata runtime entries in containerd stay. ``container`` ->
``vm-passthrough`` (or lifting an opt-out) reconciles (binds). Each change is one log
line, an Event (``WorkloadSwitched``, ``OptOutsChanged``) and a metric sample.

A relabel while no agent ran is the same leave, found by a reconcile (``catch_up``) when
katamgr's records still list GPUs the node no longer wants bound.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

from gpunode.errors import ConfigError, GpuNodeError
from gpunode.policy.workload import Operand, Resolution, Workload, describe_opt_outs
from katamgr.agent.events import NodeEvents
from katamgr.agent.giveback import GiveBacks
from katamgr.agent.health import Health
from katamgr.agent.metrics import AgentMetrics
from katamgr.agent.target import Target
from katamgr.pipeline.reconcile import Steps
from katamgr.pipeline.report import LeaveReport, Report

log = logging.getLogger("katamgr.agent")  # the agent's one logger (see drift)

PASSTHROUGH_NAME = Workload.VM_PASSTHROUGH.value
# What else a leave does, in the switch's log line and Event.
FOLLOW = ("CDI specs and readiness files follow; the Kata runtime entries in containerd stay "
          "(running VMs use them and switching back needs no containerd restart; katamgr revert removes them)")


class Switch:
    """Carries the node from one workload and set of opt-outs to another."""

    def __init__(self, target: Target, give_backs: GiveBacks, health: Health, metrics: AgentMetrics,
                 events: NodeEvents, reconcile: Callable[[str], Report],
                 read_workload: Callable[[], Resolution | Workload | str] | None = None) -> None:
        self.target = target
        self.give_backs = give_backs
        self.health = health
        self.metrics = metrics
        self.events = events
        self.reconcile = reconcile
        # The node's workload and opt-outs now (its labels, resolved as at start); None: not followed.
        self.read_workload = read_workload
        self._label_error: str | None = None  # the last failure to read it, logged once
        # The split label followed on a vm-passthrough node (``agent.splitting``); None: not followed.
        self.splitter = None

    def follow(self) -> bool:
        """Switch when the node's workload label or opt-outs changed; True when one was done."""
        if self.read_workload is None:
            return False
        t = self.target
        try:
            read = self.read_workload()
        except GpuNodeError as exc:  # the API down, a bad label value: keep what we run
            if str(exc) != self._label_error:
                log.warning("could not read the node's workload (%s); keeping %s", exc, t.steps.workload)
                if isinstance(exc, ConfigError):  # the label's own value: the operator's to mend
                    self.events.label_refused(f"{exc}; nothing was moved: the node keeps {t.steps.workload}")
            self._label_error = str(exc)
            return False
        self._label_error = None
        wanted, out = ((read.workload, read.opted_out) if isinstance(read, Resolution)
                       else (Workload(read), t.opted_out))
        if wanted is t.steps.workload and out == t.opted_out:
            return self.follow_split(read)
        return self.switch(wanted, out)

    def split_at_start(self) -> None:
        """The split label read once before the first reconcile, so it binds only the VM share."""
        if self.read_workload is None or self.splitter is None:
            return
        try:
            self.follow_split(self.read_workload())
        except GpuNodeError as exc:  # said again, and an Event for a bad value, by follow()
            log.warning("could not read the node's split label at start (%s)", exc)

    def follow_split(self, read: Resolution | Workload | str) -> bool:
        """Move GPUs between VMs and containers when the split label changed (only where the
        node binds its GPUs: a whole-node switch away from vm-passthrough gives every one back)."""
        if self.splitter is None or not isinstance(read, Resolution):
            return False
        if not self.target.binds:
            self.splitter.reset()
            return False
        return self.splitter.follow(read.split, read.split_from)

    def _binds_again(self) -> bool:
        """Whether the labels, read now, ask for the GPUs on vfio-pci again (flipped back
        while a leave waited for the kubelet)."""
        if self.read_workload is None:
            return False
        try:
            read = self.read_workload()
        except GpuNodeError:
            return False
        t = self.target
        wanted, out = ((read.workload, read.opted_out) if isinstance(read, Resolution)
                       else (Workload(read), t.opted_out))
        steps = replace(t.base_steps, workload=wanted).without(out)
        return steps.passthrough and steps.vfio

    def switch(self, workload: Workload, out: frozenset[Operand]) -> bool:
        """Carry the node to ``workload`` with the operands in ``out`` opted out; False when
        it must be tried again (the node lock is busy, a record unreadable)."""
        with self.health.busy("switching the workload"):
            return self._switch(workload, out)

    def _switch(self, workload: Workload, out: frozenset[Operand]) -> bool:
        t = self.target
        old, old_out = t.steps, t.opted_out
        new = replace(t.base_steps, workload=workload).without(out)
        started = time.monotonic()
        # When it began (the line at the end says what it did): a switch takes seconds.
        log.info("%s: starting", _change(old, old_out, new, out))
        release = old.passthrough and old.vfio and not (new.passthrough and new.vfio)
        what: list[str] = []
        readiness_off = old.readiness and not new.readiness and t.base_steps.vfio
        if release or (old.passthrough and not new.passthrough) or readiness_off:
            try:
                report = self.give_backs.leave(new, release=release, lock_wait=t.lock_wait,
                                               cancelled=self._binds_again)
            except GpuNodeError as exc:  # a busy node lock, an unreadable record: next tick
                log.warning("could not switch %s yet (%s); trying again", _change(old, old_out, new, out), exc)
                return False
            if release:
                self.give_backs.note_left(report)  # (a leave that gives nothing back keeps what is held)
                what.append(_left(report))
                # Not reverted: running VMs still use them, and a switch back needs no
                # containerd restart; `katamgr revert` removes them.
                what.append(FOLLOW)
            elif readiness_off:
                what.append("no readiness files in /run/nvidia/validations")
        self.metrics.observe_opt_outs(out)
        if new.passthrough and (not old.passthrough or new.vfio > old.vfio or new.kata > old.kata
                                or new.readiness > old.readiness):
            t.steps = new  # what the reconcile carries out
            self.give_backs.forget()
            report = self.reconcile(f"node relabeled: it runs {new.workload}, opting out of "
                                    f"{describe_opt_outs(out)}")
            bound = f"bound {', '.join(report.moved)} to vfio-pci" if report.moved else "no GPU to bind"
            what.append(bound if new.vfio else "binding is opted out (vfio-manager)")
            if report.partly:
                what.append(f"runtime class(es) {', '.join(sorted(report.classes_failed))} failed, not offered "
                            "here and retried with backoff")
            elif not report.ok:
                what.append(f"the reconcile failed, retried with backoff: {'; '.join(report.failures)}")
        if new.passthrough and old.kata and not new.kata:
            what.append("katamgr stands down on the Kata runtime: no artifact pulls or containerd edits; "
                        "the runtime entries it wrote stay for running VMs until katamgr revert")
        summary = f"{_change(old, old_out, new, out)}: {'; '.join(what) or 'nothing bound to move'}"
        log.info("%s", summary)
        if old.workload is not new.workload:
            self.metrics.workload_switches.labels(old.workload.value, new.workload.value).inc()
            self.metrics.workload_switch_seconds.labels(new.workload.value).observe(time.monotonic() - started)
        self.events.switched(old.workload is not new.workload, summary)
        # Last: whoever watches the agent sees the change once it is done and told.
        t.steps, t.opted_out, t.settled = new, out, True
        return True

    def catch_up(self) -> tuple[Report, bool]:
        """Give back the GPUs katamgr bound that the agent does not already know are held:
        the leave of a live switch, for a relabel while no agent ran (found by the first
        reconcile, said as that switch) or a device a leave could not give back (its
        failures come back for the retry); a busy node lock is a GpuNodeError. Returns what
        the reconcile reports of it, and whether it was told in a line of its own."""
        t = self.target
        found = self.give_backs.unknown()
        if not found:
            return Report(), False
        report = self.give_backs.leave(t.steps, release=True, lock_wait=t.lock_wait,
                                       command="katamgr run (giving back GPUs)")
        self.give_backs.note_left(report)
        if t.settled:  # not the first look: said by the reconcile's own lines
            return Report(changes=list(report.changes), warnings=list(report.warnings),
                          failures=list(report.failures)), False
        if t.steps.passthrough:
            change = f"opt-outs now {describe_opt_outs(t.opted_out)}"
        else:
            change = f"workload switch {PASSTHROUGH_NAME} -> {t.steps.workload}"
            self.metrics.workload_switches.labels(PASSTHROUGH_NAME, t.steps.workload.value).inc()
        summary = (f"{change}, found at start (katamgr had bound {', '.join(found)} to vfio-pci "
                   f"before this agent started): {_left(report)}; {FOLLOW}")
        log.info("%s", summary)
        self.events.switched(not t.steps.passthrough, summary)
        return Report(failures=list(report.failures)), True


def _change(old: Steps, old_out: frozenset[Operand], new: Steps, out: frozenset[Operand]) -> str:
    """What changed on the node, for the log line and the Event."""
    parts = []
    if old.workload is not new.workload:
        parts.append(f"workload switch {old.workload} -> {new.workload}")
    if old_out != out:
        parts.append(f"opt-outs now {describe_opt_outs(out)} (were {describe_opt_outs(old_out)})")
    return "; ".join(parts) or "no change"


def _left(report: LeaveReport) -> str:
    """What giving the GPUs back did, in one sentence."""
    what = (f"gave {', '.join(report.restored)} back to their drivers" if report.restored
            else "no free GPU to give back")
    if report.held:
        what += "; kept on vfio-pci, held by running VMs or pods: " + "; ".join(
            f"{bdf} ({', '.join(who)})" for bdf, who in sorted(report.held.items()))
    if report.waiting:
        what += (f"; {', '.join(sorted(report.waiting))} not opened by its VM yet, "
                 "given back once its pod is gone")
    if report.pods_unknown:
        what += (f"; could not ask the kubelet which pods hold GPUs ({report.pods_unknown}): "
                 "only the GPUs a running VM holds open were kept")
    if report.failures:
        what += f"; failed: {'; '.join(report.failures)}"
    return what
