"""``katamgr run --plan-only``: the agent that looks and never acts.

It works out what ``katamgr plan`` would print for the node, at start and then every check
interval, and publishes it: the whole plan in the log when it changes, the device gauges
on ``/metrics``, a summary on ``/readyz``. It changes nothing: no device is bound, no file
under the host root is written (not even the node lock or katamgr's records), no Node
label, RuntimeClass or Event is written. The way to see what the chart would do to a
fleet's nodes before letting it (the chart's ``kataManager.planOnly``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from gpunode.errors import GpuNodeError
from gpunode.host.vfiogroups import Action
from gpunode.services.metrics_server import MetricsServer
from gpunode.services.process import stop_on_signals
from katamgr.agent.health import Health
from katamgr.agent.metrics import AgentMetrics
from katamgr.exitcodes import Exit
from katamgr.pipeline.plan import Plan
from katamgr.render import plan_text

log = logging.getLogger("katamgr.agent")  # the agent's one logger (see drift)


def summary(plan: Plan) -> str:
    """One line for ``/readyz``: what applying would do, and the plan's problems."""
    binds = sum(d.action == Action.BIND for d in plan.devices)
    pending = [s.title for s in plan.sections if s.pending]
    would = [f"bind {binds} device(s)"] if binds else []
    would += [f"change {title}" for title in pending]
    line = f"plan only (nothing is changed): apply would {', '.join(would)}" if would else \
        "plan only (nothing is changed): the node is already as planned"
    if plan.problems:
        line += f"; {len(plan.problems)} problem(s): {'; '.join(plan.problems)}"
    return line


class PlanOnlyAgent:
    """``make_plan``: the node's plan now (read-only; it follows the workload label where
    the caller's does)."""

    def __init__(self, make_plan: Callable[[], Plan], *, check_interval: float = 60.0,
                 metrics_address: str | None = None) -> None:
        self.make_plan = make_plan
        self.check_interval = check_interval
        self.metrics_address = metrics_address
        self.metrics = AgentMetrics()
        self.probes = Health(check_interval)
        self.stop = threading.Event()
        self.last: Plan | None = None
        self.error: str | None = None  # why the last look failed (None: it did not)
        self._text = ""

    def look(self) -> Plan | None:
        """Work the plan out again; log it when it differs from the last one."""
        with self.probes.busy("planning"):
            try:
                plan = self.make_plan()
            except GpuNodeError as exc:  # an unreadable node: said, and tried again next time
                self.error = str(exc)
                log.warning("could not plan the node: %s", exc)
                return None
        self.error, self.last = None, plan
        self.metrics.observe_plan(plan)
        text = plan_text(plan)
        if text != self._text:
            self._text = text
            log.info("the node's plan (--plan-only: nothing is carried out):\n%s", text)
        return plan

    def readiness(self) -> tuple[bool, str]:
        """/readyz: ready once a plan was worked out; its message says what apply would do."""
        if self.error is not None:
            return False, f"could not plan the node: {self.error}"
        if self.last is None:
            return False, "no plan worked out yet"
        return True, summary(self.last)

    def run(self, once: bool = False) -> int:
        if once:
            plan = self.look()
            if plan is None:
                return Exit.FAILED
            return Exit.PROBLEMS if plan.problems else Exit.OK
        server = None
        if self.metrics_address:
            server = MetricsServer(self.metrics_address, self.metrics.registry, healthy=self.probes.healthy,
                                   ready=self.readiness).start()
        stop_on_signals(self.stop.set, log)
        try:
            self.look()
            while not self.stop.wait(self.check_interval):
                self.probes.tick()
                self.look()
        finally:
            if server is not None:
                server.stop()
        return Exit.OK
