"""What a pipeline step did: sentences for people, facts for the steps after it.

Steps return these; only the edge (``katamgr.render``) turns them into output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from katamgr.exitcodes import Exit, most_serious


@dataclass
class Report:
    """What a step did, for humans: every change, warning and failure as a sentence."""

    changes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    bytes_pulled: int = 0  # artifact blob bytes read from their sources (for the metrics)
    moved: list[str] = field(default_factory=list)  # BDFs moved to vfio-pci by this step
    # Runtime classes that failed on this node (name -> why, one sentence naming it): the rest
    # of the node is in place, and these are not offered here (``pipeline.offers``).
    classes_failed: dict[str, str] = field(default_factory=dict)
    # Runtime classes installed and registered with containerd on this node (None: the Kata
    # step did not run, so what is offered is not known here).
    classes_ready: list[str] | None = None
    # Runtime classes whose offer label this step set (True) or removed (False) on the Node.
    offered: dict[str, bool] = field(default_factory=dict)
    # What the plan listed as problems (a device left out: held, its group not viable; the
    # IOMMU off; no GPU), also among the warnings: the run is "done with problems".
    problems: list[str] = field(default_factory=list)
    # Processes that lost a device to --force, one sentence each (PID, command, device).
    forced: list[str] = field(default_factory=list)
    # The stop signal's exit code (130 SIGINT, 143 SIGTERM) when the run stopped at a safe
    # point before its end: what it did is in ``changes``, where it stopped in ``failures``.
    interrupted: int | None = None

    @property
    def ok(self) -> bool:
        """Nothing failed, a runtime class included."""
        return not self.failures and not self.classes_failed

    @property
    def partly(self) -> bool:
        """Done, but some runtime classes failed (named in ``classes_failed``); nothing else did."""
        return not self.failures and bool(self.classes_failed)

    def exit_code(self) -> Exit:
        """What a run that did this ends with (``katamgr.exitcodes``): failed, partly done,
        done with problems, done with --force, or done."""
        return most_serious([Exit(self.interrupted) if self.interrupted else Exit.OK,
                             Exit.FAILED if self.failures else Exit.OK,
                             Exit.PARTLY if self.classes_failed else Exit.OK,
                             Exit.PROBLEMS if self.problems else Exit.OK,
                             Exit.FORCED if self.forced else Exit.OK])

    def merge(self, other: Report) -> Report:
        self.changes += other.changes
        self.warnings += other.warnings
        self.failures += other.failures
        self.bytes_pulled += other.bytes_pulled
        self.moved += other.moved
        self.classes_failed.update(other.classes_failed)
        self.offered.update(other.offered)
        self.problems += other.problems
        self.forced += other.forced
        self.interrupted = self.interrupted or other.interrupted
        if other.classes_ready is not None:
            self.classes_ready = [*(self.classes_ready or []), *other.classes_ready]
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
