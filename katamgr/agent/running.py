"""The agent: its rooms wired together, run once (``--once``) or kept running, stopped."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from katamgr.agent import drift
from katamgr.agent.ccmode import CcModes
from katamgr.agent.events import NodeEvents
from katamgr.agent.giveback import GiveBacks
from katamgr.agent.gpuhealth import GpuHealth
from katamgr.agent.gpulabels import GpuLabels
from katamgr.agent.health import Health, readiness
from katamgr.agent.katafound import KataFound
from katamgr.agent.loop import keep
from katamgr.agent.metrics import AgentMetrics
from katamgr.agent.reconciler import RETRY_INITIAL, RETRY_MAX, Reconciler
from katamgr.agent.switch import Switch
from katamgr.agent.target import Target
from katamgr.exitcodes import Exit
from katamgr.host.cc import CcMode
from katamgr.host.naming import Naming
from katamgr.host.root import HostRoot
from katamgr.host.workload import Operand, Resolution, Workload
from katamgr.node.metrics_server import MetricsServer
from katamgr.node.nvlinkfabric import FabricSettings
from katamgr.node.process import stop_on_signals
from katamgr.node.watching import Watcher
from katamgr.pipeline import offers
from katamgr.pipeline.gpulabels import NodeLabels
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.reconcile import DEFAULT_LOCK_WAIT, Steps, revert_all
from katamgr.pipeline.report import Report
from katamgr.render import log_report

log = logging.getLogger("katamgr.agent")  # the agent's one logger (see drift)


class Agent:
    """``katamgr run``. ``events``: a ``katamgr.cluster.EventRecorder`` (None without a
    cluster); ``read_workload``: the node's workload and opt-outs now (None: not followed);
    ``node_watch``: a ``katamgr.node.kube.NodeLabelWatch`` that keeps the labels and wakes
    the loop when they change (without one they are read every check); ``node_labels``: the
    Node's labels, to publish the GPU labels on (None: not published); ``offer_labels``: the
    same, for the runtime classes offered on the node (``pipeline.offers``; None: no cluster)."""

    def __init__(self, host: HostRoot, naming: Naming, steps: Steps, ctx: KataContext | None, *,
                 force: bool = False, wait: float = 5.0, repull_interval: float = 3600.0,
                 revert_on_exit: bool = False, check_interval: float = 10.0,
                 lock_wait: float = DEFAULT_LOCK_WAIT, retry_initial: float = RETRY_INITIAL,
                 retry_max: float = RETRY_MAX, events=None, metrics_address: str | None = None,
                 read_workload: Callable[[], Resolution | Workload | str] | None = None,
                 node_watch=None, opted_out: frozenset[Operand] = frozenset(),
                 cc_default_mode: CcMode | None = None, read_labels: Callable[[], Mapping[str, str]] | None = None,
                 publish_labels: Callable[[dict[str, str | None]], None] | None = None,
                 read_resources: Callable[[], tuple[Mapping[str, str], Mapping[str, str]]] | None = None,
                 node_labels: NodeLabels | None = None, fabric: FabricSettings | None = None,
                 offer_labels: NodeLabels | None = None, kata_found: KataFound | None = None):
        self.target = Target(host, naming, steps, ctx, opted_out, force=force, wait=wait, lock_wait=lock_wait,
                             fabric=fabric)
        self.repull_interval = repull_interval
        self.check_interval = check_interval
        self.revert_on_exit = revert_on_exit
        self.metrics_address = metrics_address
        self.node_watch = node_watch
        self.stop = threading.Event()
        self._watcher: Watcher | None = None  # loop()'s, woken by request_stop()
        self.metrics = AgentMetrics()
        self.metrics.observe_opt_outs(self.target.opted_out)
        self.probes = Health(check_interval)
        self.events = NodeEvents(events)
        self.give_backs = GiveBacks(self.target, self.probes, self.events)
        self.switcher = Switch(self.target, self.give_backs, self.probes, self.metrics, self.events,
                               self.reconcile, read_workload)
        self.cc = CcModes(self.target, self.probes, self.metrics, self.events, default_mode=cc_default_mode,
                          read_labels=read_labels, publish=publish_labels, read_resources=read_resources)
        self.gpu_labels = GpuLabels(self.target, self.events, node_labels)
        self.gpu_health = GpuHealth(self.target, self.metrics, self.events)
        self.kata_found = kata_found
        if kata_found is not None:
            kata_found.remember(self.target)
        self.reconciler = Reconciler(self.target, self.probes, self.metrics, self.events, self.switcher.catch_up,
                                     retry_initial=retry_initial, retry_max=retry_max,
                                     offer_labels=offer_labels)

    # -- the work, each piece in its room -----------------------------------------

    def reconcile(self, why: str, *, raise_errors: bool = False, retry: bool = False) -> Report:
        return self.reconciler.run(why, raise_errors=raise_errors, retry=retry)

    def bind_freed(self) -> None:
        self.reconciler.bind_freed()

    def follow_workload(self) -> bool:
        return self.switcher.follow()

    def follow_cc(self) -> bool:
        return self.cc.follow()

    def follow_gpu_labels(self) -> None:
        self.gpu_labels.follow()

    def follow_gpu_health(self) -> None:
        self.gpu_health.follow()

    def follow_kata(self) -> bool:
        """Look at the node's Kata again; where it changed, reconcile to what its release
        decides (True: reconciled)."""
        why = self.kata_found.follow(self.target) if self.kata_found is not None else None
        if why is None:
            return False
        self.events.kata_changed(why)
        self.reconcile(why)
        return True

    def switch(self, workload: Workload, out: frozenset[Operand]) -> bool:
        return self.switcher.switch(workload, out)

    def release_freed(self) -> bool:
        return self.give_backs.release_freed()

    def containerd_drift(self) -> str | None:
        return drift.containerd_drift(self.target)

    def sync_cdi(self) -> Report | None:
        return drift.sync_cdi(self.target, self.metrics, self.events)

    def health(self) -> tuple[bool, str]:
        return self.probes.healthy()

    def readiness(self) -> tuple[bool, str]:
        return readiness(self.reconciler.last_result, self.reconciler.retry_at)

    def serve_metrics(self, address: str) -> MetricsServer:
        return MetricsServer(address, self.metrics.registry, healthy=self.health, ready=self.readiness).start()

    # -- running ------------------------------------------------------------------

    def run(self, once: bool = False) -> int:
        server = self.serve_metrics(self.metrics_address) if self.metrics_address and not once else None
        try:
            first = self.reconcile("start", raise_errors=once)
            self.follow_cc()
            labelled = self.gpu_labels.follow()
            if once:
                if (self.cc.last is not None and not self.cc.last.ok) or (labelled is not None and not labelled.ok):
                    return Exit.FAILED
                return first.exit_code()
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
                t = self.target
                report = revert_all(t.host, t.steps, t.ctx, lock_wait=t.lock_wait,
                                    command="katamgr run --revert-on-exit", node_labels=self.gpu_labels.node)
                if self.reconciler.offer_labels is not None:
                    report.merge(offers.withdraw(self.reconciler.offer_labels))
                log_report(report, log)

    def loop(self) -> None:
        watcher = self._watcher = Watcher()
        try:
            keep(self, watcher)
        finally:
            watcher.close()

    def request_stop(self) -> None:
        self.stop.set()
        watcher = self._watcher
        if watcher is not None:
            watcher.wake()  # a sleeping loop stops at once
