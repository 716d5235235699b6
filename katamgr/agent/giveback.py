"""Give-backs: the GPUs a leave of vm-passthrough kept on vfio-pci, given back once free.

A leave (``pipeline.reconcile.leave_passthrough``) keeps a GPU a running VM holds open,
or one the kubelet gave a pod whose VM is still starting. The agent remembers them and
looks at them every check, cheaply: which of them a VM holds open (their ``/dev/vfio``
nodes in ``/proc``) and, for one nobody holds open that a pod was given, whether the
kubelet still lists that pod's device. The leave (node lock, PCI scan, CDI specs) runs
again only when one of those let go.
"""

from __future__ import annotations

import logging

from gpunode.errors import GpuNodeError
from gpunode.host import vfio
from gpunode.services.podresources import (
    Assignment,
    PodDevices,
    assigned_functions,
    list_pod_devices,
)
from katamgr.agent.events import NodeEvents
from katamgr.agent.health import Health
from katamgr.agent.target import Target
from katamgr.pipeline.reconcile import Steps, leave_passthrough
from katamgr.pipeline.report import LeaveReport
from katamgr.render import log_report

log = logging.getLogger("katamgr.agent")  # the agent's one logger (see drift)


class GiveBacks:
    """The held GPUs and what kept each: a VM, or a pod the kubelet gave it."""

    def __init__(self, target: Target, health: Health, events: NodeEvents | None = None) -> None:
        self.target = target
        self.health = health
        self.events = events or NodeEvents()
        self.held: set[str] = set()  # BDFs a leave left on vfio-pci because a pod or VM holds them
        self.waiting: dict[str, list[str]] = {}  # the last LeaveReport.waiting, logged when it changes
        # Per held BDF, what the kubelet had given pods of it at the last leave: while those
        # are all still listed, a GPU no VM holds open is still theirs (release_freed).
        self._given: dict[str, frozenset[Assignment]] = {}
        self._asked: PodDevices | None = None  # the kubelet's answer the last leave went by

    def forget(self) -> None:
        """The node binds again: nothing is waiting to be given back."""
        self.held, self._given = set(), {}

    def unknown(self) -> list[str]:
        """The GPUs katamgr's records list as bound that no leave of this agent's kept."""
        return sorted(set(vfio.bound_by_us(self.target.host)) - self.held)

    def leave(self, steps: Steps, *, release: bool, lock_wait: float,
              command: str = "katamgr run (workload switch)", cancelled=None) -> LeaveReport:
        """``leave_passthrough``, remembering the kubelet's answer it went by (``cancelled()``:
        the node wants its GPUs bound again, stop waiting for the kubelet)."""
        self._asked = None
        t = self.target
        return leave_passthrough(t.host, t.naming, steps, release=release,
                                 readiness_owned=t.base_steps.vfio, lock_wait=lock_wait,
                                 command=command, pod_devices=self._ask_pods, cancelled=cancelled)

    def _ask_pods(self) -> PodDevices:
        self._asked = list_pod_devices(self.target.host)
        return self._asked

    def note_left(self, report: LeaveReport) -> None:
        """Remember what a leave kept (given back once free: with the rest of each one's
        IOMMU group, which stays with it) and what the kubelet had given pods of it, and log
        a new wait once."""
        host = self.target.host
        kept = set(report.held) | set(report.waiting)
        records = vfio.bound_by_us(host) if kept else {}
        groups = {records[bdf].get("group") for bdf in kept if bdf in records} - {None}
        self.held = kept | {bdf for bdf, record in records.items() if record.get("group") in groups}
        self._given = {}
        asked = self._asked
        if self.held and asked is not None and asked.assignments:
            # The leave's own scan is gone: the held GPUs are still on vfio-pci, and a
            # rescan names the same units (the plugin's IDs) for them.
            given = assigned_functions(host, self.target.scan(), self.target.naming, asked.assignments)
            self._given = {bdf: frozenset(given[bdf]) for bdf in self.held if given.get(bdf)}
        if report.waiting != self.waiting and report.waiting:
            log.info("%s", next(w for w in report.warnings if w.startswith("kept on vfio-pci:")))
        self.waiting = dict(report.waiting)

    def release_freed(self) -> bool:
        """After a switch away from binding: give back a held GPU once its pod and VM are
        gone (True when a leave ran). A kubelet that cannot be asked is asked again at the
        next check (the pod's GPU stays meanwhile)."""
        t = self.target
        if not self.held or t.binds:
            return False
        with self.health.busy("giving back GPUs"):
            records = vfio.bound_by_us(t.host)
            self.held &= set(records)
            freed = self._let_go(records)
            if not freed:
                return False
            try:
                # No wait for the node lock: whoever holds it is done by the next check.
                report = self.leave(t.steps, release=t.base_steps.vfio, lock_wait=0)
            except GpuNodeError as exc:
                log.info("could not give back %s yet (%s); trying again", ", ".join(freed), exc)
                return False
            self.note_left(report)
            if report.changes or report.failures:
                log_report(report, log)
            if report.restored:
                self.events.given_back(f"gave {', '.join(report.restored)} back to their drivers: "
                                       "the VMs and pods that held them are gone")
            return True

    def _let_go(self, records: dict[str, dict]) -> list[str]:
        """The held devices nothing keeps any more, by IOMMU group (a group moves whole):
        no VM holds a device of it open, and no pod the kubelet still lists was given one."""
        host = self.target.host
        groups: dict[object, list[str]] = {}
        for bdf in sorted(self.held):
            group = records[bdf].get("group")
            groups.setdefault(bdf if group is None else group, []).append(bdf)
        loose = [bdfs for bdfs in groups.values()
                 if not any(vfio.vfio_holders(host, bdf, records[bdf].get("group")) for bdf in bdfs)]
        freed = [bdf for bdfs in loose if not any(self._given.get(b) for b in bdfs) for bdf in bdfs]
        waiting = [bdfs for bdfs in loose if any(self._given.get(b) for b in bdfs)]
        if waiting:
            asked = list_pod_devices(host)
            if asked.unknown is None:
                listed = set(asked.assignments)
                freed += [bdf for bdfs in waiting
                          if not any(self._given.get(b) and self._given[b] <= listed for b in bdfs)
                          for bdf in bdfs]
            else:
                log.debug("cannot ask the kubelet about %s (%s); asking again at the next check",
                          ", ".join(b for bdfs in waiting for b in bdfs), asked.unknown)
        return sorted(freed)
