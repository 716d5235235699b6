"""One reconcile of the agent's, and what follows it: metrics, Events, the retry backoff.

A failed reconcile is retried with capped exponential backoff (2 s doubling to 5 min,
reset by a success), not on the artifact timer. The agent's reconcile is the pipeline's;
on a node that wants none of katamgr's binding (another workload, or opted out of
``vfio-manager``) the GPUs katamgr's records still list are first given back as on a live
switch (``Switch.catch_up``), where a one-shot ``katamgr apply`` only says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

from gpunode.errors import GpuNodeError
from gpunode.host.vfiogroups import Action, SkipReason
from gpunode.services.backoff import Backoff, Retries
from katamgr.agent.events import NodeEvents
from katamgr.agent.health import Health
from katamgr.agent.metrics import AgentMetrics
from katamgr.agent.offergate import OfferGate
from katamgr.agent.target import Target
from katamgr.pipeline import nvlinkfabric, offers
from katamgr.pipeline.gpulabels import NodeLabels
from katamgr.pipeline.reconcile import reconcile
from katamgr.pipeline.report import Report
from katamgr.render import log_report

log = logging.getLogger("katamgr.agent")  # the agent's one logger (see drift)

# A failed reconcile is tried again after 2 s, 4 s, ... at most 5 min apart.
RETRY_INITIAL = 2.0
RETRY_MAX = 300.0


class Reconciler:
    """Runs reconciles under the node lock and keeps their outcome: the last result, the
    count, the retry schedule, and whether a GPU was skipped because a process held it."""

    def __init__(self, target: Target, health: Health, metrics: AgentMetrics, events: NodeEvents,
                 catch_up: Callable[[], tuple[Report, bool]], *, retry_initial: float = RETRY_INITIAL,
                 retry_max: float = RETRY_MAX, offer_labels: NodeLabels | None = None,
                 gate: OfferGate | None = None) -> None:
        self.target = target
        self.health = health
        self.metrics = metrics
        self.events = events
        self.catch_up = catch_up
        self.retries = Retries(Backoff(retry_initial, 2.0, retry_max))
        self.reconciles = 0
        self.last_result: Report | None = None
        self.retry_at: float | None = None  # monotonic time of the next retry
        self.in_use = False  # the last reconcile skipped a GPU a process held: bind it once free
        self.offer_labels = offer_labels  # the Node's labels, for the classes offered (None: no cluster)
        # The offer gate (``agent.offergate``): the classes ready here are offered only while the
        # kubelet can give our devices (None: offered once ready, as with no device plugin beside).
        self.gate = gate
        self.offer_ready: list[str] | None = None  # the classes the last reconcile found ready

    @property
    def retry_delay(self) -> float | None:
        """The backoff now pending after failures (None: the last reconcile succeeded)."""
        return self.retries.delay

    def run(self, why: str, *, raise_errors: bool = False, retry: bool = False) -> Report:
        """One reconcile under the node lock; an error that stopped it before any
        change (a busy lock, a bad input) is logged and tried again later. ``retry``: the
        backoff's retry, which after a partial success looks up only the classes that failed."""
        log.info("reconciling: %s", why)
        started = time.monotonic()
        told = False
        last = self.last_result
        only = frozenset(last.classes_failed) if retry and last is not None and last.partly else None
        with self.health.busy("reconciling"):
            try:
                report, told = self._reconcile_node(only)
            except GpuNodeError as exc:
                if raise_errors:
                    raise
                report = Report(failures=[str(exc)])
            except Exception as exc:  # a bug must not end the loop: retried like any failure
                if raise_errors:
                    raise
                log.exception("unexpected error while reconciling")
                report = Report(failures=[f"unexpected {type(exc).__name__}: {exc}"])
        self.reconciles += 1
        log_report(report, log, "" if told else "nothing to change")
        self._after(report, time.monotonic() - started)
        return report

    def _reconcile_node(self, only: frozenset[str] | None = None) -> tuple[Report, bool]:
        """The pipeline's reconcile, after giving back what the node no longer wants bound;
        and whether that give-back was told in a line of its own. ``only``: the runtime classes
        to look up again (the others are installed and left as they are)."""
        t = self.target
        ctx = replace(t.ctx, retry_classes=only) if t.ctx is not None and only is not None else t.ctx
        report, told = Report(), False
        gives_back = t.gives_back
        if gives_back:
            caught_up, told = self.catch_up()
            report.merge(caught_up)
        report.merge(reconcile(t.host, t.naming, t.steps, ctx, force=t.force, wait=t.wait,
                               lock_wait=t.lock_wait, command="katamgr run", gives_back=gives_back,
                               kata_found=t.kata_found))
        t.settled = True
        report.merge(self._offer(report))
        return report, told

    def _offer(self, report: Report) -> Report:
        """The Node's offer labels after a reconcile: the classes ready here, none where the node
        runs no Kata of ours (another workload, kata-manager opted out), the metric per class."""
        t = self.target
        if t.ctx is None:
            return Report()
        configured = [rc.name for rc in t.ctx.config.runtime_classes]
        kata = t.steps.passthrough and t.steps.kata
        ready = report.classes_ready if kata else []  # None: the Kata step did not get to run
        self.metrics.observe_classes(configured, ready)
        if self.offer_labels is None or ready is None:
            return Report()
        self.offer_ready = list(ready)
        if self.gate is not None:
            self.gate.look()
            ready = ready if self.gate.open else []
        return offers.publish(self.offer_labels, offers.wanted(configured, ready))

    def follow_offers(self) -> Report | None:
        """Between reconciles: the offer gate asked again, the labels brought to its verdict
        when it changed (None: no change, or nothing gated)."""
        g, t = self.gate, self.target
        if g is None or self.offer_labels is None or self.offer_ready is None or t.ctx is None:
            return None
        if not g.look():
            return None
        configured = [rc.name for rc in t.ctx.config.runtime_classes]
        report = offers.publish(self.offer_labels, offers.wanted(configured, self.offer_ready if g.open else []))
        log_report(report, log, "")
        self.events.offers_gated(report, g.why)
        return report

    def _after(self, report: Report, seconds: float) -> None:
        """Metrics, Events and the retry schedule after one reconcile."""
        m = self.metrics
        result = "success" if report.ok else "partial" if report.partly else "failure"
        m.reconcile_seconds.labels(result).observe(seconds)
        m.reconciles.labels(result).inc()
        m.artifact_bytes.inc(report.bytes_pulled)
        failed_before = self.last_result is not None and not self.last_result.ok
        self.last_result = report
        if report.ok:
            m.last_success.set_to_current_time()
            self.retries.succeeded()
            self.retry_at = None
            m.retry_delay.set(0)
        else:
            m.reconcile_errors.inc(len(report.failures) + len(report.classes_failed))
            delay = self.retries.failed()
            self.retry_at = time.monotonic() + delay
            m.retry_delay.set(delay)
            log.warning("%s; retrying in %.0f s", "runtime class(es) " + ", ".join(sorted(report.classes_failed))
                        + " failed" if report.partly else "reconcile failed", delay)
        try:
            plan = self.target.plan()
            m.observe_plan(plan)
            if self.target.binds:
                self.events.nvswitches(plan.inventory, plan.kata_found.warning if plan.kata_found else "")
                if self.target.fabric is not None:
                    self._nvlink_fabric(plan)
            self.in_use = self.target.binds and any(
                d.skipped_because is SkipReason.IN_USE for d in plan.decisions)
        except Exception as exc:  # noqa: BLE001 - the metrics never fail the loop
            log.debug("could not scan the devices for the metrics: %s", exc)
        self.events.reconciled(report, failed_before)

    def _nvlink_fabric(self, plan) -> None:
        """An NVSwitch board's model (``pipeline.nvlinkfabric``, asking FM, bounded): the
        ``katamgr_nvlink_fabric_model`` metric, and a Warning Event where neither holds."""
        before = len(plan.problems)
        nvlinkfabric.add_section(self.target.host, plan, self.target.fabric)
        section = next((s for s in plan.sections if s.key == "nvlink_fabric"), None)
        if section is None:
            return
        self.metrics.observe_nvlink_model(section.data["model"])
        for problem in plan.problems[before:]:
            self.events.nvlink_fabric(problem)

    def bind_freed(self) -> None:
        """On a vm-passthrough node: bind a GPU the last reconcile skipped because a process
        held it (say the container plugin leaving after a relabel) once it is free, without
        waiting for the hourly check."""
        t = self.target
        if not self.in_use or not t.binds:
            return
        if any(d.action is Action.BIND for d in t.plan(replace(t.steps, kata=False)).decisions):
            self.run("a GPU that was in use is free now")
