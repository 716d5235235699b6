"""The loop: what runs when, and nothing else (each piece of work is another room's).

It sleeps until an inotify event in containerd's config dir, a relabel (the Node watch
wakes it), a stop request or, at the latest, every check interval: the checks are cheap
and cover a lost event (sysfs sends none for a kernel's driver change). While a leave keeps
GPUs for running VMs, those alone are looked at every second (a VM's end sends no event). A failed
reconcile is retried when its backoff is up; the artifacts are re-checked on a timer.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from inotify_simple import flags as inflags

from katamgr.agent.drift import containerd_dirs
from katamgr.errors import KatamgrError
from katamgr.node.watching import Watcher

if TYPE_CHECKING:
    from katamgr.agent.running import Agent

log = logging.getLogger("katamgr.agent")  # the agent's one logger (see drift)

# The ways an editor, a package upgrade or another tool replaces or edits containerd's config.
HELD_POLL = 1.0

_WATCH = inflags.CLOSE_WRITE | inflags.MOVED_TO | inflags.CREATE | inflags.DELETE | inflags.MOVED_FROM


def keep(agent: Agent, watcher: Watcher) -> None:
    """Keep the node as reconciled until the agent is asked to stop."""
    if agent.node_watch is not None:
        # The labels are read from the watch, not the API. One look now covers a change
        # that came before this hook was set.
        agent.node_watch.on_change = watcher.wake
        watcher.wake()
    for directory in containerd_dirs(agent.target):
        try:
            watcher.add_watch(directory, _WATCH)
            log.info("watching %s for changes to containerd's config", agent.target.host.host_path(directory))
        except OSError as exc:
            log.warning("cannot watch %s (%s); checking every 10 s instead", directory, exc.strerror)
    next_pull = time.monotonic() + agent.repull_interval
    next_check = time.monotonic()
    while not agent.stop.is_set():
        agent.probes.tick()
        retry_at = agent.reconciler.retry_at
        due = min(next_pull, retry_at if retry_at is not None else next_pull, next_check)
        # A VM letting go of its GPUs sends no event (its /dev/vfio fds close in /proc):
        # while GPUs wait for their VMs, those alone are looked at every HELD_POLL seconds.
        polling = bool(agent.give_backs.held)
        if polling:
            due = min(due, time.monotonic() + HELD_POLL)
        events = watcher.wait(max(0.0, due - time.monotonic()))
        if agent.stop.is_set():
            break
        agent.probes.tick()
        if polling and events == [] and _only_poll(agent, next_check, next_pull):
            continue  # the held GPUs' poll, and none let go
        # (otherwise what woke it does not matter: the checks look at the files themselves)
        next_check = time.monotonic() + agent.check_interval
        if agent.reconciler.retry_at is not None and time.monotonic() >= agent.reconciler.retry_at:
            agent.reconcile(f"retry after a failure (backoff {agent.reconciler.retry_delay:g} s)", retry=True)
            continue
        try:
            if _check(agent):
                continue
        except KatamgrError as exc:  # an unreadable config, a failed scan: next time
            log.warning("could not check the node: %s", exc)
        if time.monotonic() >= next_pull:
            agent.reconcile("periodic artifact check")
            next_pull = time.monotonic() + agent.repull_interval


def _only_poll(agent: Agent, next_check: float, next_pull: float) -> bool:
    """Between checks, with nothing else due: give back what its VM let go (False when that
    gave something back, so the whole check follows)."""
    now = time.monotonic()
    retry_at = agent.reconciler.retry_at
    if now >= min(next_check, next_pull, retry_at if retry_at is not None else next_pull):
        return False
    try:
        return not agent.release_freed()
    except KatamgrError as exc:
        log.warning("could not check the held GPUs: %s", exc)
        return True


def _check(agent: Agent) -> bool:
    """One check; True when it switched the workload, which is a whole tick's work."""
    if agent.follow_workload():
        return True
    if agent.follow_cc():
        return True
    # Before the labels: a Kata installed or upgraded since changes the release label.
    agent.follow_kata()
    agent.follow_gpu_labels()
    agent.follow_gpu_health()
    # Held GPUs before drift: a GPU given back or bound changes what the CDI specs should say.
    agent.release_freed()
    agent.bind_freed()
    drift = agent.containerd_drift()
    if drift:
        agent.reconcile(drift)  # which rewrites the CDI specs too
    else:
        agent.sync_cdi()
    return False
