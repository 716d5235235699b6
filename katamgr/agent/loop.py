"""The loop: what runs when, and nothing else (each piece of work is another module's).

It sleeps until an inotify event in containerd's config dir, a relabel (the Node watch
wakes it), a stop request or, at the latest, every check interval: the checks are cheap
and cover a lost event (sysfs sends none for a kernel's driver change). While a leave keeps
GPUs for running VMs, or a split change keeps GPUs for their pods and VMs, those alone are
looked at every second (a VM's end sends no event). A failed reconcile is retried when its
backoff is up; the artifacts are re-checked on a timer.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from inotify_simple import flags as inflags

from gpunode.errors import GpuNodeError
from gpunode.services.watching import Watcher
from katamgr.agent.kubeletwatch import KubeletWatch

log = logging.getLogger("katamgr.agent")  # the agent's one logger (see drift)

# The ways an editor, a package upgrade or another tool replaces or edits containerd's config.
HELD_POLL = 1.0

_WATCH = inflags.CLOSE_WRITE | inflags.MOVED_TO | inflags.CREATE | inflags.DELETE | inflags.MOVED_FROM


class Kept(Protocol):
    """What the loop needs of the agent it runs (``running.Agent``): its timers, its stop
    flag, and each piece of work by name; how a piece is done is the business of the agent's other modules."""

    stop: threading.Event
    check_interval: float
    repull_interval: float
    node_watch: Any  # a NodeLabelWatch whose on_change wakes the loop, or None
    kubelet_watch: KubeletWatch | None  # with the offer gate: its ears on the kubelet

    def config_dirs(self) -> list[tuple[Path, str]]:
        """The directories whose changes may drop our runtimes: (where to watch, the host's name)."""
        ...

    def tick(self) -> None:
        """Tell /healthz the loop is alive."""
        ...

    def retry_at(self) -> float | None:
        """When a failed reconcile is retried (time.monotonic), or None."""
        ...

    def retry(self) -> None: ...

    def holding(self) -> bool:
        """Whether GPUs wait on vfio-pci for their VMs to let go."""
        ...

    def reconcile(self, why: str) -> object: ...

    def release_freed(self) -> bool: ...

    def bind_freed(self) -> None: ...

    def follow_workload(self) -> bool: ...

    def follow_cc(self) -> bool: ...

    def follow_kata(self) -> bool: ...

    def follow_gpu_labels(self) -> None: ...

    def follow_gpu_health(self) -> None: ...

    def follow_offers(self) -> None: ...

    def containerd_drift(self) -> str | None: ...

    def sync_cdi(self) -> object: ...


def keep(agent: Kept, watcher: Watcher) -> None:
    """Keep the node as reconciled until the agent is asked to stop."""
    if agent.node_watch is not None:
        # The labels are read from the watch, not the API. One look now covers a change
        # that came before this hook was set.
        agent.node_watch.on_change = watcher.wake
        watcher.wake()
    for directory, shown in agent.config_dirs():
        try:
            watcher.add_watch(directory, _WATCH)
            log.info("watching %s for changes to containerd's config", shown)
        except OSError as exc:
            log.warning("cannot watch %s (%s); checking every 10 s instead", directory, exc.strerror)
    # With the offer gate, the kubelet's or a device plugin's socket changing or its server
    # ending wakes it too (agent.kubeletwatch): then the offers alone are followed, at once
    # and every fraction of a second while that is pending.
    hears = agent.kubelet_watch
    if hears is not None:
        hears.start(watcher)
    try:
        _keep(agent, watcher, hears)
    finally:
        if hears is not None:
            hears.stop()


def _keep(agent: Kept, watcher: Watcher, hears: KubeletWatch | None) -> None:
    next_pull = time.monotonic() + agent.repull_interval
    next_check = time.monotonic()
    while not agent.stop.is_set():
        agent.tick()
        retry_at = agent.retry_at()
        due = min(next_pull, retry_at if retry_at is not None else next_pull, next_check)
        gate_due = hears.due() if hears is not None else None
        if gate_due is not None:
            due = min(due, gate_due)
        # A VM letting go of its GPUs sends no event (its /dev/vfio fds close in /proc):
        # while GPUs wait for their VMs, those alone are looked at every HELD_POLL seconds.
        polling = agent.holding()
        if polling:
            due = min(due, time.monotonic() + HELD_POLL)
        events = watcher.wait(max(0.0, due - time.monotonic()))
        if agent.stop.is_set():
            break
        agent.tick()
        if hears is not None:
            try:  # the offers followed on what the gate heard: its events are spent here
                events = hears.follow(events, agent.follow_offers)
            except GpuNodeError as exc:
                log.warning("could not follow the offers: %s", exc)
        if events == []:
            if polling:
                if _only_poll(agent, next_check, next_pull):
                    continue  # the held GPUs' poll, and none let go
            elif not _due(agent, next_check, next_pull):
                continue  # only the gate's look was due
        # (otherwise what woke it does not matter: the checks look at the files themselves)
        next_check = time.monotonic() + agent.check_interval
        retry_at = agent.retry_at()
        if retry_at is not None and time.monotonic() >= retry_at:
            agent.retry()
            continue
        try:
            if _check(agent):
                continue
        except GpuNodeError as exc:  # an unreadable config, a failed scan: next time
            log.warning("could not check the node: %s", exc)
        if time.monotonic() >= next_pull:
            agent.reconcile("periodic artifact check")
            next_pull = time.monotonic() + agent.repull_interval


def _due(agent: Kept, next_check: float, next_pull: float) -> bool:
    """Whether a check, an artifact pull or a retry is due now."""
    retry_at = agent.retry_at()
    return time.monotonic() >= min(next_check, next_pull, retry_at if retry_at is not None else next_pull)


def _only_poll(agent: Kept, next_check: float, next_pull: float) -> bool:
    """Between checks, with nothing else due: give back what its VM let go (False when that
    gave something back, so the whole check follows)."""
    if _due(agent, next_check, next_pull):
        return False
    try:
        return not agent.release_freed()
    except GpuNodeError as exc:
        log.warning("could not check the held GPUs: %s", exc)
        return True


def _check(agent: Kept) -> bool:
    """One check; True when it switched the workload, which is a whole tick's work."""
    if agent.follow_workload():
        return True
    if agent.follow_cc():
        return True
    # Before the labels: a Kata installed or upgraded since changes the release label.
    agent.follow_kata()
    agent.follow_gpu_labels()
    agent.follow_gpu_health()
    agent.follow_offers()  # the kubelet's devices came or went: the offer labels follow
    # Held GPUs before drift: a GPU given back or bound changes what the CDI specs should say.
    agent.release_freed()
    agent.bind_freed()
    drift = agent.containerd_drift()
    if drift:
        agent.reconcile(drift)  # which rewrites the CDI specs too
    else:
        agent.sync_cdi()
    return False
