"""Carry out a plan on the node, and undo it."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from katamgr.host import readiness, vfio
from katamgr.host.root import HostRoot
from katamgr.host.vfio import Action
from katamgr.plan import Plan

log = logging.getLogger(__name__)


@dataclass
class Report:
    """What a step did, for humans: every change, warning and failure as a sentence."""

    changes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def merge(self, other: Report) -> Report:
        self.changes += other.changes
        self.warnings += other.warnings
        self.failures += other.failures
        return self


def apply_host(host: HostRoot, plan: Plan, *, workload: str = "vm-passthrough", wait: float = 5.0) -> Report:
    """Bind what the plan says to bind, then write the readiness files."""
    report = Report()
    result = vfio.bind(host, plan.decisions, wait=wait)
    report.changes += result.changes
    report.failures += result.failures
    for change in result.changes:
        log.info("%s", change)
    usable = any(d.action in (Action.BIND, Action.KEEP) for d in plan.decisions)
    if report.ok and usable:
        report.changes += [f"wrote {p}" for p in readiness.mark_ready(host, workload)]
    return report


def revert_host(host: HostRoot, *, force: bool = False) -> Report:
    report = Report()
    report.changes += [f"removed {p}" for p in readiness.clear_ready(host)]
    result = vfio.unbind_all(host, force=force)
    report.changes += result.changes
    report.failures += result.failures
    return report
