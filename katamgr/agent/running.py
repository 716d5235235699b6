"""The agent: its modules wired together, run once (``--once``) or kept running, stopped."""

from __future__ import annotations

import logging
import threading
import uuid
from pathlib import Path

from gpunode.policy.workload import Operand, Workload
from gpunode.services.metrics_server import MetricsServer
from gpunode.services.process import stop_on_signals
from gpunode.services.watching import Watcher
from katamgr.agent import drift
from katamgr.agent.ccmode import CcModes
from katamgr.agent.conditions import node_conditions
from katamgr.agent.events import NodeEvents
from katamgr.agent.giveback import GiveBacks
from katamgr.agent.gpuhealth import GpuHealth
from katamgr.agent.gpulabels import GpuLabels
from katamgr.agent.health import Health, readiness
from katamgr.agent.kubeletwatch import KubeletWatch
from katamgr.agent.loop import keep
from katamgr.agent.metrics import AgentMetrics
from katamgr.agent.offergate import OfferGate
from katamgr.agent.reconciler import Reconciler
from katamgr.agent.rejected import RejectedPods
from katamgr.agent.settings import NO_CLUSTER, AgentSettings, NodeLinks
from katamgr.agent.splitting import SplitKeeper
from katamgr.agent.switch import Switch
from katamgr.agent.target import Target
from katamgr.exitcodes import Exit
from katamgr.pipeline import kata_verify, offers
from katamgr.pipeline.reconcile import revert_all
from katamgr.pipeline.report import Report
from katamgr.render import log_report

log = logging.getLogger("katamgr.agent")  # the agent's one logger (see drift)


class Agent:
    """``katamgr run``: the agent's modules wired together for ``settings``, reaching the cluster
    through ``links`` (``agent.settings``; ``agent.build`` makes both from the command line
    and an API client)."""

    def __init__(self, settings: AgentSettings, links: NodeLinks = NO_CLUSTER):
        s = settings
        self.settings = settings
        self.target = Target(s.host, s.naming, s.steps, s.ctx, s.opted_out, force=s.force, wait=s.wait,
                             lock_wait=s.lock_wait, fabric=s.fabric, kata_found=s.kata_on_node)
        self.repull_interval = s.repull_interval
        self.check_interval = s.check_interval
        self.revert_on_exit = s.revert_on_exit
        self.metrics_address = s.metrics_address
        self.node_watch = links.node_watch
        self.stop = threading.Event()
        self._watcher: Watcher | None = None  # loop()'s, woken by request_stop()
        self.metrics = AgentMetrics()
        self.metrics.observe_opt_outs(self.target.opted_out)
        self.probes = Health(s.check_interval)
        self.events = NodeEvents(links.events)
        self.give_backs = GiveBacks(self.target, self.probes, self.events)
        self.switcher = Switch(self.target, self.give_backs, self.probes, self.metrics, self.events,
                               self.reconcile, links.read_workload)
        self.splitter = SplitKeeper(self.target, self.metrics, self.events, self.reconcile)
        self.splitter.dra = s.ctx is not None and s.ctx.config.dra
        self.switcher.splitter = self.splitter
        self.cc = CcModes(self.target, self.probes, self.metrics, self.events, default_mode=s.cc_default_mode,
                          read_labels=links.read_labels, publish=links.publish_labels,
                          read_resources=links.read_resources)
        self.gpu_labels = GpuLabels(self.target, self.events, links.node_labels)
        self.gpu_health = GpuHealth(self.target, self.metrics, self.events, link_policy=s.link_policy)
        self.conditions = links.conditions
        self.kata_found = s.kata_found
        if s.kata_found is not None:
            s.kata_found.remember(self.target)
        # After each reconcile the node's Kata artifacts are verified and the verdict written
        # (kata_verify); /readyz reads it back, stamped with this agent, as a rollout's gate.
        self.verifier = kata_verify.Verifier(f"katamgr-run-{uuid.uuid4().hex[:12]}")
        self._unverified_said: tuple[str, ...] = ()  # the problems last told on the Node
        gate = OfferGate(self.target) if s.offer_gate else None
        if gate is not None and s.rejected_pods == "event" and links.failed_pods is not None:
            rejected = RejectedPods(links.failed_pods, lambda: gate.resources, self.events)
            gate.on_open, gate.while_open = rejected.opened, rejected.still_open
        self.reconciler = Reconciler(self.target, self.probes, self.metrics, self.events, self.switcher.catch_up,
                                     retry_initial=s.retry_initial, retry_max=s.retry_max,
                                     offer_labels=links.offer_labels, gate=gate)
        # The gate hears the kubelet and our plugins restart (agent.kubeletwatch); no gate, no ears.
        self.kubelet_watch = (None if gate is None else
                              KubeletWatch(self.target.host, lambda: gate.resources, lambda: gate.open))

    # -- the work, each piece in its module ---------------------------------------

    def reconcile(self, why: str, *, raise_errors: bool = False, retry: bool = False) -> Report:
        try:
            self.splitter.reapply()  # a split node binds only its VM share, whoever set the naming
            report = self.reconciler.run(why, raise_errors=raise_errors, retry=retry)
            # What this reconcile installed is the agent's own doing: detection looks again now, so
            # the next check does not take it for kata-deploy's; where the release it decides
            # changed, once more to carry that out.
            found = self.kata_found.follow(self.target, ours=True) if self.kata_found is not None else None
            if found is not None:
                self.splitter.reapply()
                report = self.reconciler.run(found, raise_errors=raise_errors, retry=retry)
                if self.kata_found is not None:
                    self.kata_found.follow(self.target, ours=True)
            self.verify(report)
            return report
        finally:
            self.publish_conditions()

    def verify(self, report: Report | None = None) -> kata_verify.Verification:
        """Verify the node's Kata artifacts as the config asks for them (``verified.json``)."""
        t = self.target
        result = self.verifier.verify(t.host, t.ctx, kata=t.steps.kata)
        if report is not None and not report.failures:
            # A class the reconcile failed has its RuntimeClassFailed Event; one it went through
            # with, yet left off the config's artifacts (a new artifact kept out, the old one
            # running), is said here, once per verdict: every reconcile verifies again.
            unverified = tuple(p for c in result.classes if not c.ok and c.name not in report.classes_failed
                               for p in c.problems)
            if unverified and unverified != self._unverified_said:
                self.events.artifacts_unverified(list(unverified))
            self._unverified_said = unverified
        return result

    def publish_conditions(self) -> None:
        """The Node's conditions from the metrics just observed (an API write only on a change)."""
        if self.conditions is not None:
            self.conditions.publish(node_conditions(self.metrics, self.target.binds))

    def bind_freed(self) -> None:
        self.reconciler.bind_freed()

    def follow_workload(self) -> bool:
        return self.switcher.follow()

    def follow_cc(self) -> bool:
        return self.cc.follow()

    def follow_gpu_labels(self) -> None:
        self.gpu_labels.follow()

    def follow_offers(self) -> None:
        self.reconciler.follow_offers()

    def follow_gpu_health(self) -> None:
        self.gpu_health.follow()
        self.publish_conditions()

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
        freed = self.give_backs.release_freed()
        return self.splitter.poll() or freed

    def containerd_drift(self) -> str | None:
        return drift.containerd_drift(self.target)

    def sync_cdi(self) -> Report | None:
        return drift.sync_cdi(self.target, self.metrics, self.events)

    # -- what the loop asks (loop.Kept) -------------------------------------------

    def config_dirs(self) -> list[tuple[Path, str]]:
        return [(d, str(self.target.host.host_path(d))) for d in drift.containerd_dirs(self.target)]

    def tick(self) -> None:
        self.probes.tick()

    def retry_at(self) -> float | None:
        return self.reconciler.retry_at

    def retry(self) -> None:
        self.reconcile(f"retry after a failure (backoff {self.reconciler.retry_delay:g} s)", retry=True)

    def holding(self) -> bool:
        return bool(self.give_backs.held) or self.splitter.waiting

    def health(self) -> tuple[bool, str]:
        return self.probes.healthy()

    def readiness(self) -> tuple[bool, str]:
        """/readyz: the last reconcile succeeded and this agent verified the node's artifacts."""
        ready, why = readiness(self.reconciler.last_result, self.reconciler.retry_at)
        if not ready:
            return ready, why
        verified, how = kata_verify.readiness(self.target.host, self.verifier.writer)
        return verified, f"{why}; {how}"


    def serve_metrics(self, address: str) -> MetricsServer:
        return MetricsServer(address, self.metrics.registry, healthy=self.health, ready=self.readiness).start()

    # -- running ------------------------------------------------------------------

    def run(self, once: bool = False) -> int:
        server = self.serve_metrics(self.metrics_address) if self.metrics_address and not once else None
        if not once:
            # From the start: a pod deleted during its first reconcile (and its verification)
            # finishes that step and stops, rather than dying half-way with the default action.
            stop_on_signals(self.request_stop, log)
        try:
            self.switcher.split_at_start()  # the split label, before the first bind
            first = self.reconcile("start", raise_errors=once)
            self.follow_cc()
            labelled = self.gpu_labels.follow()
            if once:
                if (self.cc.last is not None and not self.cc.last.ok) or (labelled is not None and not labelled.ok):
                    return Exit.FAILED
                return first.exit_code()
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
            self.stand_down()
            if self.revert_on_exit:
                log.info("reverting on exit (--revert-on-exit)")
                t = self.target
                report = revert_all(t.host, t.steps, t.ctx, lock_wait=t.lock_wait,
                                    command="katamgr run --revert-on-exit", node_labels=self.gpu_labels.node)
                if self.reconciler.offer_labels is not None:
                    report.merge(offers.withdraw(self.reconciler.offer_labels))
                log_report(report, log)

    def stand_down(self) -> None:
        """With the offer gate: the offer labels off first, the pods bound before taken by the
        kubelet, then the plugin beside told it may stop (``agent.offergate``)."""
        r = self.reconciler
        if r.gate is None:
            return
        labels = r.offer_labels

        def withdraw() -> None:
            report = offers.withdraw(labels)
            log_report(report, log, "")
            self.events.offers_gated(report, "the agent is stopping, and the device plugin beside it")

        try:
            # No labels to take off (no cluster, no Kata): the plugin is told at once all the same.
            r.gate.stand_down(None if labels is None else withdraw)
        except Exception as exc:  # noqa: BLE001 - stopping goes on; the plugin's own bound ends its wait
            log.warning("could not stand down in order: %s", exc)

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
