"""What a pipeline step did: sentences for people, facts for the steps after it.

Steps return these; only the edge (``katamgr.render``) turns them into output.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Report:
    """What a step did, for humans: every change, warning and failure as a sentence."""

    changes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    bytes_pulled: int = 0  # artifact blob bytes read from their sources (for the metrics)
    moved: list[str] = field(default_factory=list)  # BDFs moved to vfio-pci by this step

    @property
    def ok(self) -> bool:
        return not self.failures

    def merge(self, other: Report) -> Report:
        self.changes += other.changes
        self.warnings += other.warnings
        self.failures += other.failures
        self.bytes_pulled += other.bytes_pulled
        self.moved += other.moved
        return self


@dataclass
class LeaveReport(Report):
    """What ``leave_passthrough`` did: the sentences, and which devices went where."""

    restored: list[str] = field(default_factory=list)  # BDFs given back to their drivers
    held: dict[str, list[str]] = field(default_factory=dict)  # BDFs left on vfio-pci: who holds them
    pods: dict[str, list[str]] = field(default_factory=dict)  # BDFs the kubelet gave pods: which pods
    # BDFs given to a pod whose VM has not opened them yet: kept (with their group) for the pod
    waiting: dict[str, list[str]] = field(default_factory=dict)
    pods_unknown: str | None = None  # why the kubelet could not say which pods hold GPUs
