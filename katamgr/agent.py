"""``katamgr run``: the node agent's loop.

Reconcile once, then keep the node that way: the GPU Operator's kata manager
misses it when someone else's containerd edit or restart drops our runtime
entries, so we watch the containerd config (inotify, not polling) and re-apply
only when our entries are really gone. The CDI specs follow the devices on
vfio-pci (checked every few seconds: a hotplug or a re-bind by hand must not
leave Kata a name that no longer resolves, or one that names another GPU).
Artifacts are re-checked on a timer (drift); a failed reconcile is retried with
capped exponential backoff (2 s doubling to 5 min, reset by a success), not on that
timer. With ``--metrics-address`` it serves ``/metrics``, ``/healthz`` (the loop
ticked recently) and ``/readyz`` (the last reconcile succeeded); with a cluster
and a node name it records Events on the Node for every change and failure.

With a cluster and a node name it also follows its Node's labels: the workload label
(``nvidia.com/gpu.workload.config``) and the GPU Operator's opt-outs
(``nvidia.com/gpu.deploy.<operand>=false``, ``katamgr.host.workload.Operand``), kept by
a watch on the Node (``katamgr.host.kube.NodeLabelWatch``) that wakes the loop, so a
relabel is acted on at once, not at the next check. ``vm-passthrough`` → ``container``
(or opting out of ``vfio-manager``) gives the GPUs no pod or VM holds back to their
drivers, leaves the held ones on vfio-pci (reported, and given back once they are
free), and makes the CDI specs and readiness files follow; the Kata runtime entries in
containerd stay. ``container`` → ``vm-passthrough`` (or lifting an opt-out) reconciles
(binds). Each change is one log line, an Event (``WorkloadSwitched``,
``OptOutsChanged``) and a metric sample (``katamgr_workload_switches_total``,
``katamgr_opted_out``).

A relabel while no agent ran is found when one starts (and by ``katamgr run --once``):
on a node that does not run VMs, or opts out of ``vfio-manager``, every reconcile of
the agent gives back the GPUs katamgr's records still list as bound by it, the same
leave as a live switch (plain ``katamgr apply`` there only says so). A held GPU is then
looked at every check, cheaply: the leave runs again only once a VM let go of one, or
the kubelet no longer lists the pod that was given one. A switch, a reconcile and a
give-back mark the agent busy, so ``/healthz`` does not fail while one runs long.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from inotify_simple import flags as inflags
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from katamgr.errors import KatamgrError
from katamgr.host import vfio
from katamgr.host.inventory import discover
from katamgr.host.lock import NodeBusyError, node_lock
from katamgr.host.metrics_server import MetricsServer
from katamgr.host.naming import Naming
from katamgr.host.podresources import Assignment, PodDevices, assigned_functions, list_pod_devices
from katamgr.host.process import stop_on_signals
from katamgr.host.root import HostRoot
from katamgr.host.vfio import Action, SkipReason
from katamgr.host.watching import Watcher
from katamgr.host.workload import Operand, Resolution, Workload, describe_opt_outs
from katamgr.pipeline import cdi_specs, kata_runtime
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.plan import Plan
from katamgr.pipeline.reconcile import (
    DEFAULT_LOCK_WAIT,
    Steps,
    full_plan,
    leave_passthrough,
    reconcile,
    revert_all,
)
from katamgr.pipeline.report import LeaveReport, Report
from katamgr.render import log_report
from katamgr.runtime import check_entries, configure_containerd

log = logging.getLogger(__name__)

# A failed reconcile is tried again after 2 s, 4 s, ... at most 5 min apart.
RETRY_INITIAL = 2.0
RETRY_MAX = 300.0
# /healthz fails when the loop has not ticked for this long (a reconcile in progress
# may take up to BUSY_LIMIT: a blob download alone is bounded at 30 min).
STALE_AFTER = 120.0
BUSY_LIMIT = 3600.0

_WATCH = inflags.CLOSE_WRITE | inflags.MOVED_TO | inflags.CREATE | inflags.DELETE | inflags.MOVED_FROM


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


class Agent:
    def __init__(self, host: HostRoot, naming: Naming, steps: Steps, ctx: KataContext | None, *,
                 force: bool = False, wait: float = 5.0, repull_interval: float = 3600.0,
                 revert_on_exit: bool = False, check_interval: float = 10.0,
                 lock_wait: float = DEFAULT_LOCK_WAIT, retry_initial: float = RETRY_INITIAL,
                 retry_max: float = RETRY_MAX, events=None, metrics_address: str | None = None,
                 read_workload: Callable[[], Resolution | Workload | str] | None = None,
                 node_watch=None, opted_out: frozenset[Operand] = frozenset()):
        self.host = host
        self.naming = naming
        # What the command line asks for; the node's opt-outs take parts away (steps).
        self.base_steps = steps
        self.opted_out = frozenset(opted_out)
        self.steps = steps.without(self.opted_out)
        self.ctx = ctx
        self.force = force
        self.wait = wait
        self.repull_interval = repull_interval
        self.check_interval = check_interval
        self.lock_wait = lock_wait
        self.revert_on_exit = revert_on_exit
        self.stop = threading.Event()
        self.reconciles = 0
        self._watcher: Watcher | None = None  # loop()'s, woken by request_stop()
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.retry_delay: float | None = None  # the backoff now pending after failures
        self.retry_at: float | None = None  # monotonic time of the next retry
        self.events = events  # a katamgr.cluster.EventRecorder, or None without a cluster
        self.metrics = AgentMetrics()
        self.metrics_address = metrics_address
        self.last_result: Report | None = None
        self.last_tick = time.monotonic()
        self.busy_since: float | None = None  # a reconcile, switch or give-back in progress
        self.busy_with = ""  # what it is, for /healthz
        # The node's workload and opt-outs now (its labels, resolved as at start); None: not
        # followed. node_watch (a katamgr.host.kube.NodeLabelWatch) keeps the labels and
        # wakes the loop when they change; without one they are read every check.
        self.read_workload = read_workload
        self.node_watch = node_watch
        self._label_error: str | None = None  # the last failure to read it, logged once
        self.held: set[str] = set()  # BDFs a switch left on vfio-pci because a pod or VM holds them
        self._waiting: dict[str, list[str]] = {}  # the last LeaveReport.waiting, logged when it changes
        # Per held BDF, what the kubelet had given pods of it at the last leave: while those
        # are all still listed, a GPU no VM holds open is still theirs (release_freed).
        self._given: dict[str, frozenset[Assignment]] = {}
        self._asked: PodDevices | None = None  # the kubelet's answer the last leave went by
        self._followed = False  # a reconcile or a switch of this agent's has set the node's GPUs
        self._told = False  # this reconcile's change was told in a line of its own
        self._in_use = False  # the last reconcile skipped a GPU a process held: bind it once free
        for operand in Operand:
            self.metrics.opted_out.labels(operand.value).set(int(operand in self.opted_out))

    # -- health ------------------------------------------------------------------

    def health(self) -> tuple[bool, str]:
        """/healthz: the loop ticked recently (or a reconcile is running, for a bounded time)."""
        now = time.monotonic()
        since = self.busy_since
        if since is not None:
            busy = now - since
            return busy < BUSY_LIMIT, f"{self.busy_with or 'busy'} for {busy:.0f} s"
        idle = now - self.last_tick
        limit = max(STALE_AFTER, 3 * self.check_interval)
        return idle < limit, f"loop last ticked {idle:.0f} s ago (limit {limit:.0f} s)"

    def readiness(self) -> tuple[bool, str]:
        """/readyz: the last reconcile succeeded."""
        last = self.last_result
        if last is None:
            return False, "no reconcile has finished yet"
        if not last.ok:
            retry = f"; retrying in {max(0.0, self.retry_at - time.monotonic()):.0f} s" if self.retry_at else ""
            return False, f"the last reconcile failed: {'; '.join(last.failures)}{retry}"
        return True, "the last reconcile succeeded"

    def serve_metrics(self, address: str) -> MetricsServer:
        return MetricsServer(address, self.metrics.registry, healthy=self.health, ready=self.readiness).start()

    @contextmanager
    def _busy(self, what: str) -> Iterator[None]:
        """Mark the agent busy (``/healthz`` stays good up to BUSY_LIMIT) while ``what`` runs;
        a nested mark (a switch's reconcile) keeps the outer one."""
        outer = self.busy_since is not None
        if not outer:
            self.busy_with, self.busy_since = what, time.monotonic()
        try:
            yield
        finally:
            if not outer:
                self.busy_since = None
            self.last_tick = time.monotonic()

    def request_stop(self) -> None:
        self.stop.set()
        watcher = self._watcher
        if watcher is not None:
            watcher.wake()  # a sleeping loop stops at once

    def reconcile(self, why: str, *, raise_errors: bool = False) -> Report:
        """One reconcile under the node lock; an error that stopped it before any
        change (a busy lock, a bad input) is logged and tried again later."""
        log.info("reconciling: %s", why)
        started = time.monotonic()
        self._told = False
        with self._busy("reconciling"):
            try:
                report = self._reconcile_node()
            except KatamgrError as exc:
                if raise_errors:
                    raise
                report = Report(failures=[str(exc)])
            except Exception as exc:  # a bug must not end the loop: retried like any failure
                if raise_errors:
                    raise
                log.exception("unexpected error while reconciling")
                report = Report(failures=[f"unexpected {type(exc).__name__}: {exc}"])
        self.reconciles += 1
        log_report(report, log, "" if self._told else "nothing to change")
        self._after_reconcile(report, time.monotonic() - started)
        return report

    def _reconcile_node(self) -> Report:
        """The agent's reconcile: the pipeline's, except on a node that wants none of
        katamgr's binding (another workload, or opted out of ``vfio-manager``). There the
        GPUs katamgr's records still list (the node was relabeled while no agent ran) are
        given back as on a live switch, where a one-shot ``katamgr apply`` only says so."""
        report = Report()
        gives_back = self._gives_back()
        if gives_back:
            report.merge(self._leave_recorded())
        if self.steps.passthrough or not gives_back:
            report.merge(reconcile(self.host, self.naming, self.steps, self.ctx, force=self.force,
                                   wait=self.wait, lock_wait=self.lock_wait, command="katamgr run"))
        else:
            # The pipeline's own words here would advise `katamgr revert` for GPUs the
            # agent gives back by itself once they are free.
            report.warnings.append(
                f"node workload is {self.steps.workload.value!r}: nothing to do for VM passthrough here")
        self._followed = True
        return report

    def _gives_back(self) -> bool:
        """Whether katamgr binds GPUs here at all (no --no-vfio) but the node wants none bound."""
        return self.base_steps.vfio and not (self.steps.passthrough and self.steps.vfio)

    def _leave_recorded(self) -> Report:
        """Give back the GPUs katamgr bound that the agent does not already know are held:
        the leave of a live switch, for a relabel while no agent ran (found by the first
        reconcile, said as that switch) or a device a leave could not give back (its
        failures come back for the retry); a busy node lock is a KatamgrError."""
        recorded = vfio.bound_by_us(self.host)
        found = sorted(set(recorded) - self.held)
        if not found:
            return Report()
        report = self._leave(self.steps, release=True, lock_wait=self.lock_wait,
                             command="katamgr run (giving back GPUs)")
        self._note_left(report)
        if self._followed:  # not the first look: said by the reconcile's own lines
            return Report(changes=list(report.changes), warnings=list(report.warnings),
                          failures=list(report.failures))
        if self.steps.passthrough:
            change = f"opt-outs now {describe_opt_outs(self.opted_out)}"
        else:
            change = f"workload switch {PASSTHROUGH_NAME} -> {self.steps.workload}"
            self.metrics.workload_switches.labels(PASSTHROUGH_NAME, self.steps.workload.value).inc()
        summary = (f"{change}, found at start (katamgr had bound {', '.join(found)} to vfio-pci "
                   f"before this agent started): {_left(report)}; {FOLLOW}")
        log.info("%s", summary)
        self._told = True
        if self.events is not None:
            self.events.record("OptOutsChanged" if self.steps.passthrough else "WorkloadSwitched", summary)
        return Report(failures=list(report.failures))

    def _leave(self, steps: Steps, *, release: bool, lock_wait: float,
               command: str = "katamgr run (workload switch)") -> LeaveReport:
        """``leave_passthrough``, remembering the kubelet's answer it went by."""
        self._asked = None
        return leave_passthrough(self.host, self.naming, steps, release=release,
                                 readiness_owned=self.base_steps.vfio, lock_wait=lock_wait,
                                 command=command, pod_devices=self._ask_pods)

    def _ask_pods(self) -> PodDevices:
        self._asked = list_pod_devices(self.host)
        return self._asked

    def _after_reconcile(self, report: Report, seconds: float) -> None:
        """Metrics, Events and the retry schedule after one reconcile."""
        m = self.metrics
        result = "success" if report.ok else "failure"
        m.reconcile_seconds.labels(result).observe(seconds)
        m.reconciles.labels(result).inc()
        m.artifact_bytes.inc(report.bytes_pulled)
        failed_before = self.last_result is not None and not self.last_result.ok
        self.last_result = report
        if report.ok:
            m.last_success.set_to_current_time()
            self.retry_delay = self.retry_at = None
            m.retry_delay.set(0)
        else:
            m.reconcile_errors.inc(len(report.failures))
            self.retry_delay = (self.retry_initial if self.retry_delay is None
                                else min(self.retry_delay * 2, self.retry_max))
            self.retry_at = time.monotonic() + self.retry_delay
            m.retry_delay.set(self.retry_delay)
            log.warning("reconcile failed; retrying in %.0f s", self.retry_delay)
        try:
            plan = full_plan(self.host, self.naming, self.steps, None, force=self.force)
            m.observe_plan(plan)
            self._in_use = self.steps.passthrough and self.steps.vfio and any(
                d.skipped_because is SkipReason.IN_USE for d in plan.decisions)
        except Exception as exc:  # noqa: BLE001 - the metrics never fail the loop
            log.debug("could not scan the devices for the metrics: %s", exc)
        self._record_events(report, failed_before)

    def _record_events(self, report: Report, failed_before: bool) -> None:
        if self.events is None:
            return
        if report.failures:
            self.events.record("ReconcileFailed", "; ".join(report.failures), "Warning")
        if report.changes:
            self.events.record("Reconciled", "; ".join(report.changes))
        elif report.ok and failed_before:
            self.events.record("Reconciled", "the node is as planned again after a failed reconcile")

    def _containerd_paths(self) -> list[Path]:
        if self.ctx is None or not self.steps.kata:
            return []
        main = self.host.path(self.ctx.config.containerd.config_path)
        return [main.parent]

    def containerd_drift(self) -> str | None:
        """Why containerd's config no longer matches what we would write, if it does not."""
        if self.ctx is None or not self.steps.kata or not self.steps.passthrough:
            return None
        wanted = kata_runtime.runtimes(self.host, self.ctx)
        if not wanted:
            return None
        containerd = self.ctx.config.containerd
        missing = check_entries(self.host, containerd.config_path, wanted)
        if missing:
            return f"containerd config lost our runtimes {', '.join(missing)} (edited or replaced by someone else)"
        # Our entries are there, but e.g. a 1.x drop-in must carry the operator's
        # later edits to the main file: a dry run says whether a write is due.
        change = configure_containerd(self.host, wanted, containerd.config_path, containerd.version,
                                      enable_cdi=self.steps.cdi, dry_run=True)
        if change.changed:
            return f"{change.path} differs from what katamgr would write (an edit elsewhere to carry over)"
        return None

    def sync_cdi(self) -> Report | None:
        """Rewrite the CDI specs when the devices on vfio-pci changed under us
        (hotplug, a re-bind by hand), so every name Kata resolves stays true."""
        if not (self.steps.cdi and self.steps.passthrough):
            return None
        inv = discover(self.host, self.naming.selection)
        found, _ = cdi_specs.changes(self.host, inv, self.naming)
        stale = [c for c in found if c.action != "keep"]
        if not stale:
            return None
        log.info("CDI specs out of step with the devices on vfio-pci (%s): rewriting",
                 ", ".join(f"{c.action} {c.path}" for c in stale))
        try:
            with node_lock(self.host, "katamgr run (CDI specs)", 0):
                # Under the lock the devices may have moved on: look again.
                report = cdi_specs.write_specs(self.host, discover(self.host, self.naming.selection), self.naming)
        except NodeBusyError:
            log.info("another katamgr holds the node lock; the CDI specs are checked again next time")
            return None
        log_report(report, log)
        self.metrics.cdi_syncs.inc()
        if self.events is not None:
            if report.failures:
                self.events.record("CdiSpecsFailed", "; ".join(report.failures), "Warning")
            if report.changes:
                self.events.record("CdiSpecsUpdated", "; ".join(report.changes))
        return report

    # -- following the workload label -------------------------------------------

    def follow_workload(self) -> bool:
        """Switch when the node's workload label or opt-outs changed; True when one was done."""
        if self.read_workload is None:
            return False
        try:
            read = self.read_workload()
        except KatamgrError as exc:  # the API down, a bad label value: keep what we run
            if str(exc) != self._label_error:
                log.warning("could not read the node's workload (%s); keeping %s", exc, self.steps.workload)
            self._label_error = str(exc)
            return False
        self._label_error = None
        wanted, out = ((read.workload, read.opted_out) if isinstance(read, Resolution)
                       else (Workload(read), self.opted_out))
        if wanted is self.steps.workload and out == self.opted_out:
            return False
        return self.switch(wanted, out)

    def switch_workload(self, new: Workload) -> bool:
        """Carry the node from its workload to ``new``; False when it must be tried again."""
        return self.switch(new, self.opted_out)

    def switch(self, workload: Workload, out: frozenset[Operand]) -> bool:
        """Carry the node to ``workload`` with the operands in ``out`` opted out; False when
        it must be tried again (the node lock is busy, a record unreadable)."""
        with self._busy("switching the workload"):
            return self._switch(workload, out)

    def _switch(self, workload: Workload, out: frozenset[Operand]) -> bool:
        old, old_out = self.steps, self.opted_out
        new = replace(self.base_steps, workload=workload).without(out)
        release = old.passthrough and old.vfio and not (new.passthrough and new.vfio)
        what: list[str] = []
        readiness_off = old.readiness and not new.readiness and self.base_steps.vfio
        if release or (old.passthrough and not new.passthrough) or readiness_off:
            try:
                report = self._leave(new, release=release, lock_wait=self.lock_wait)
            except KatamgrError as exc:  # a busy node lock, an unreadable record: next tick
                log.warning("could not switch %s yet (%s); trying again", _change(old, old_out, new, out), exc)
                return False
            if release:
                self._note_left(report)  # (a leave that gives nothing back keeps what is held)
                what.append(_left(report))
                # Not reverted: running VMs still use them, and a switch back needs no
                # containerd restart; `katamgr revert` removes them.
                what.append(FOLLOW)
            elif readiness_off:
                what.append("no readiness files in /run/nvidia/validations")
        for operand in Operand:
            self.metrics.opted_out.labels(operand.value).set(int(operand in out))
        if new.passthrough and (not old.passthrough or new.vfio > old.vfio or new.kata > old.kata
                                or new.readiness > old.readiness):
            self.steps, self.held, self._given = new, set(), {}  # what the reconcile carries out
            report = self.reconcile(f"node relabeled: it runs {new.workload}, opting out of "
                                    f"{describe_opt_outs(out)}")
            bound = f"bound {', '.join(report.moved)} to vfio-pci" if report.moved else "no GPU to bind"
            what.append(bound if new.vfio else "binding is opted out (vfio-manager)")
            if not report.ok:
                what.append(f"the reconcile failed, retried with backoff: {'; '.join(report.failures)}")
        if new.passthrough and old.kata and not new.kata:
            what.append("katamgr stands down on the Kata runtime: no artifact pulls or containerd edits; "
                        "the runtime entries it wrote stay for running VMs until katamgr revert")
        summary = f"{_change(old, old_out, new, out)}: {'; '.join(what) or 'nothing bound to move'}"
        log.info("%s", summary)
        if old.workload is not new.workload:
            self.metrics.workload_switches.labels(old.workload.value, new.workload.value).inc()
        if self.events is not None:
            self.events.record("WorkloadSwitched" if old.workload is not new.workload else "OptOutsChanged",
                               summary)
        # Last: whoever watches the agent sees the change once it is done and told.
        self.steps, self.opted_out, self._followed = new, out, True
        return True

    def _note_left(self, report: LeaveReport) -> None:
        """Remember what a leave kept (given back once free: with the rest of each one's
        IOMMU group, which stays with it) and what the kubelet had given pods of it, and log
        a new wait once."""
        kept = set(report.held) | set(report.waiting)
        records = vfio.bound_by_us(self.host) if kept else {}
        groups = {records[bdf].get("group") for bdf in kept if bdf in records} - {None}
        self.held = kept | {bdf for bdf, record in records.items() if record.get("group") in groups}
        self._given = {}
        asked = self._asked
        if self.held and asked is not None and asked.assignments:
            # The leave's own scan is gone: the held GPUs are still on vfio-pci, and a
            # rescan names the same units (the plugin's IDs) for them.
            given = assigned_functions(self.host, discover(self.host, self.naming.selection), self.naming,
                                       asked.assignments)
            self._given = {bdf: frozenset(given[bdf]) for bdf in self.held if given.get(bdf)}
        if report.waiting != self._waiting and report.waiting:
            log.info("%s", next(w for w in report.warnings if w.startswith("kept on vfio-pci:")))
        self._waiting = dict(report.waiting)

    def bind_freed(self) -> None:
        """On a vm-passthrough node: bind a GPU the last reconcile skipped because a process
        held it (say the container plugin leaving after a relabel) once it is free, without
        waiting for the hourly check. Looked at every check while one is skipped."""
        if not self._in_use or not (self.steps.passthrough and self.steps.vfio):
            return
        plan = full_plan(self.host, self.naming, replace(self.steps, kata=False), None, force=self.force)
        if any(d.action is Action.BIND for d in plan.decisions):
            self.reconcile("a GPU that was in use is free now")

    def release_freed(self) -> None:
        """After a switch away from binding: give back a held GPU once its pod and VM are gone.

        Looked at every check while one is held, cheaply: which held GPUs a VM holds open
        (their ``/dev/vfio`` nodes in ``/proc``) and, for one nobody holds open that a pod
        was given (its VM still starting), whether the kubelet still lists that pod's
        device. The leave (node lock, PCI scan, CDI specs) runs again only when one of
        those let go. A kubelet that cannot be asked is asked again at the next check
        (the pod's GPU stays meanwhile).
        """
        if not self.held or (self.steps.passthrough and self.steps.vfio):
            return
        with self._busy("giving back GPUs"):
            records = vfio.bound_by_us(self.host)
            self.held &= set(records)
            freed = self._let_go(records)
            if not freed:
                return
            try:
                report = self._leave(self.steps, release=self.base_steps.vfio, lock_wait=0)
            except KatamgrError as exc:
                log.info("could not give back %s yet (%s); trying again", ", ".join(freed), exc)
                return
            self._note_left(report)
            if report.changes or report.failures:
                log_report(report, log)

    def _let_go(self, records: dict[str, dict]) -> list[str]:
        """The held devices nothing keeps any more, by IOMMU group (a group moves whole):
        no VM holds a device of it open, and no pod the kubelet still lists was given one."""
        groups: dict[object, list[str]] = {}
        for bdf in sorted(self.held):
            group = records[bdf].get("group")
            groups.setdefault(bdf if group is None else group, []).append(bdf)
        loose = [bdfs for bdfs in groups.values()
                 if not any(vfio.vfio_holders(self.host, bdf, records[bdf].get("group")) for bdf in bdfs)]
        freed = [bdf for bdfs in loose if not any(self._given.get(b) for b in bdfs) for bdf in bdfs]
        waiting = [bdfs for bdfs in loose if any(self._given.get(b) for b in bdfs)]
        if waiting:
            asked = list_pod_devices(self.host)
            if asked.unknown is None:
                listed = set(asked.assignments)
                freed += [bdf for bdfs in waiting
                          if not any(self._given.get(b) and self._given[b] <= listed for b in bdfs)
                          for bdf in bdfs]
            else:
                log.debug("cannot ask the kubelet about %s (%s); asking again at the next check",
                          ", ".join(b for bdfs in waiting for b in bdfs), asked.unknown)
        return sorted(freed)

    def run(self, once: bool = False) -> int:
        server = self.serve_metrics(self.metrics_address) if self.metrics_address and not once else None
        try:
            first = self.reconcile("start", raise_errors=once)
            if once:
                return 0 if first.ok else 1
            stop_on_signals(self.request_stop, log)
            self._loop_and_revert()
        finally:
            if server is not None:
                server.stop()
            if self.node_watch is not None:
                self.node_watch.stop()
        return 0

    def _loop_and_revert(self) -> None:
        try:
            self.loop()
        finally:
            if self.revert_on_exit:
                log.info("reverting on exit (--revert-on-exit)")
                log_report(revert_all(self.host, self.steps, self.ctx, lock_wait=self.lock_wait,
                                      command="katamgr run --revert-on-exit"), log)

    def loop(self) -> None:
        watcher = self._watcher = Watcher()
        if self.node_watch is not None:
            # A relabel wakes the loop; the labels are read from the watch, not the API.
            # One look now covers a change that came before this hook was set.
            self.node_watch.on_change = watcher.wake
            watcher.wake()
        for directory in self._containerd_paths():
            try:
                watcher.add_watch(directory, _WATCH)
                log.info("watching %s for changes to containerd's config", self.host.host_path(directory))
            except OSError as exc:
                log.warning("cannot watch %s (%s); checking every 10 s instead", directory, exc.strerror)
        next_pull = time.monotonic() + self.repull_interval
        try:
            while not self.stop.is_set():
                self.last_tick = time.monotonic()
                due = min(next_pull, self.retry_at if self.retry_at is not None else next_pull)
                timeout = max(0.0, min(due - time.monotonic(), self.check_interval))
                # Woken by an inotify event, a stop request or, at the latest, every
                # check_interval: checking our entries and the CDI specs is cheap and
                # covers a lost event (sysfs sends none for a kernel's driver change).
                watcher.wait(timeout)  # the events themselves do not matter: the files do
                if self.stop.is_set():
                    break
                self.last_tick = time.monotonic()
                if self.retry_at is not None and time.monotonic() >= self.retry_at:
                    self.reconcile(f"retry after a failure (backoff {self.retry_delay:g} s)")
                    continue
                try:
                    if self.follow_workload():
                        continue
                    self.release_freed()
                    self.bind_freed()
                    drift = self.containerd_drift()
                    if drift:
                        self.reconcile(drift)
                    else:
                        self.sync_cdi()
                except KatamgrError as exc:  # an unreadable config, a failed scan: next time
                    log.warning("could not check the node: %s", exc)
                if time.monotonic() >= next_pull:
                    self.reconcile("periodic artifact check")
                    next_pull = time.monotonic() + self.repull_interval
        finally:
            watcher.close()


PASSTHROUGH_NAME = Workload.VM_PASSTHROUGH.value
# What else a leave does, in the switch's log line and Event.
FOLLOW = ("CDI specs and readiness files follow; the Kata runtime entries in containerd stay "
          "(running VMs use them and switching back needs no containerd restart; katamgr revert removes them)")


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
