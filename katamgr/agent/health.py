"""``/healthz`` and ``/readyz``: the loop ticks, and the last reconcile succeeded."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from katamgr.pipeline.report import Report

# /healthz fails when the loop has not ticked for this long (a reconcile in progress
# may take up to BUSY_LIMIT: a blob download alone is bounded at 30 min).
STALE_AFTER = 120.0
BUSY_LIMIT = 3600.0


class Health:
    """When the loop last ticked, and what long piece of work (a reconcile, a switch, a
    give-back) it is in now: a probe must not restart an agent that is busy, only one
    that hangs."""

    def __init__(self, check_interval: float) -> None:
        self.check_interval = check_interval
        self.last_tick = time.monotonic()
        self.busy_since: float | None = None
        self.busy_with = ""

    def tick(self) -> None:
        self.last_tick = time.monotonic()

    @contextmanager
    def busy(self, what: str) -> Iterator[None]:
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
            self.tick()

    def healthy(self) -> tuple[bool, str]:
        """/healthz: the loop ticked recently (or a reconcile is running, for a bounded time)."""
        now = time.monotonic()
        since = self.busy_since
        if since is not None:
            busy = now - since
            return busy < BUSY_LIMIT, f"{self.busy_with or 'busy'} for {busy:.0f} s"
        idle = now - self.last_tick
        limit = max(STALE_AFTER, 3 * self.check_interval)
        return idle < limit, f"loop last ticked {idle:.0f} s ago (limit {limit:.0f} s)"


def readiness(last: Report | None, retry_at: float | None) -> tuple[bool, str]:
    """/readyz: the last reconcile succeeded; the runtime classes that failed are named."""
    if last is None:
        return False, "no reconcile has finished yet"
    if last.partly:
        retry = f"; retrying in {max(0.0, retry_at - time.monotonic()):.0f} s" if retry_at else ""
        return False, (f"runtime class(es) {', '.join(sorted(last.classes_failed))} failed and are not offered "
                       f"on this node: {'; '.join(last.classes_failed.values())}{retry}")
    if not last.ok:
        retry = f"; retrying in {max(0.0, retry_at - time.monotonic()):.0f} s" if retry_at else ""
        return False, f"the last reconcile failed: {'; '.join(last.failures)}{retry}"
    return True, "the last reconcile succeeded"
