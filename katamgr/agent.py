"""``katamgr run``: the node agent's loop.

Reconcile once, then keep the node that way: the GPU Operator's kata manager
misses it when someone else's containerd edit or restart drops our runtime
entries, so we watch the containerd config (inotify, not polling) and re-apply
only when our entries are really gone. The CDI specs follow the devices on
vfio-pci (checked every few seconds: a hotplug or a re-bind by hand must not
leave Kata a name that no longer resolves, or one that names another GPU).
Artifacts are re-checked on a timer.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from inotify_simple import flags as inflags

from katamgr.errors import KatamgrError
from katamgr.host.inventory import discover
from katamgr.host.lock import NodeBusyError, node_lock
from katamgr.host.naming import Naming
from katamgr.host.process import stop_on_signals
from katamgr.host.root import HostRoot
from katamgr.host.watching import Watcher
from katamgr.pipeline import cdi_specs, kata_runtime
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.reconcile import DEFAULT_LOCK_WAIT, Steps, reconcile, revert_all
from katamgr.pipeline.report import Report
from katamgr.render import log_report
from katamgr.runtime import check_entries, configure_containerd

log = logging.getLogger(__name__)

_WATCH = inflags.CLOSE_WRITE | inflags.MOVED_TO | inflags.CREATE | inflags.DELETE | inflags.MOVED_FROM


class Agent:
    def __init__(self, host: HostRoot, naming: Naming, steps: Steps, ctx: KataContext | None, *,
                 force: bool = False, wait: float = 5.0, repull_interval: float = 3600.0,
                 revert_on_exit: bool = False, check_interval: float = 10.0,
                 lock_wait: float = DEFAULT_LOCK_WAIT):
        self.host = host
        self.naming = naming
        self.steps = steps
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

    def request_stop(self) -> None:
        self.stop.set()
        watcher = self._watcher
        if watcher is not None:
            watcher.wake()  # a sleeping loop stops at once

    def reconcile(self, why: str, *, raise_errors: bool = False) -> Report:
        """One reconcile under the node lock; an error that stopped it before any
        change (a busy lock, a bad input) is logged and tried again later."""
        log.info("reconciling: %s", why)
        try:
            report = reconcile(self.host, self.naming, self.steps, self.ctx, force=self.force,
                               wait=self.wait, lock_wait=self.lock_wait, command="katamgr run")
        except KatamgrError as exc:
            if raise_errors:
                raise
            report = Report(failures=[str(exc)])
        self.reconciles += 1
        log_report(report, log, "nothing to change")
        return report

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
        inv = discover(self.host)
        found, _ = cdi_specs.changes(self.host, inv, self.naming)
        stale = [c for c in found if c.action != "keep"]
        if not stale:
            return None
        log.info("CDI specs out of step with the devices on vfio-pci (%s): rewriting",
                 ", ".join(f"{c.action} {c.path}" for c in stale))
        try:
            with node_lock(self.host, "katamgr run (CDI specs)", 0):
                # Under the lock the devices may have moved on: look again.
                report = cdi_specs.write_specs(self.host, discover(self.host), self.naming)
        except NodeBusyError:
            log.info("another katamgr holds the node lock; the CDI specs are checked again next time")
            return None
        log_report(report, log)
        return report

    def run(self, once: bool = False) -> int:
        first = self.reconcile("start", raise_errors=once)
        if once:
            return 0 if first.ok else 1
        stop_on_signals(self.request_stop, log)
        try:
            self.loop()
        finally:
            if self.revert_on_exit:
                log.info("reverting on exit (--revert-on-exit)")
                log_report(revert_all(self.host, self.steps, self.ctx, lock_wait=self.lock_wait,
                                      command="katamgr run --revert-on-exit"), log)
        return 0

    def loop(self) -> None:
        watcher = self._watcher = Watcher()
        for directory in self._containerd_paths():
            try:
                watcher.add_watch(directory, _WATCH)
                log.info("watching %s for changes to containerd's config", self.host.host_path(directory))
            except OSError as exc:
                log.warning("cannot watch %s (%s); checking every 10 s instead", directory, exc.strerror)
        next_pull = time.monotonic() + self.repull_interval
        try:
            while not self.stop.is_set():
                timeout = max(0.0, min(next_pull - time.monotonic(), self.check_interval))
                # Woken by an inotify event, a stop request or, at the latest, every
                # check_interval: checking our entries and the CDI specs is cheap and
                # covers a lost event (sysfs sends none for a kernel's driver change).
                watcher.wait(timeout)  # the events themselves do not matter: the files do
                if self.stop.is_set():
                    break
                drift = self.containerd_drift()
                if drift:
                    self.reconcile(drift)
                else:
                    self.sync_cdi()
                if time.monotonic() >= next_pull:
                    self.reconcile("periodic artifact check")
                    next_pull = time.monotonic() + self.repull_interval
        finally:
            watcher.close()
