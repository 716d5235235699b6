"""The run journal: which step a ``katamgr apply`` or ``revert`` has reached, on disk.

A run killed part-way (kill -9, a power cut, an OOM kill) prints nothing more, so each
step is written to ``/var/lib/kata-sandbox-manager/run.json`` as it starts and as it ends,
and ``katamgr status`` reads it back: a run whose record has no end and whose process is
gone was interrupted at the step named. The same steps go to a listener (the progress
lines a command prints on stderr), so what a terminal showed and what the node recorded
agree.

The journal is a witness, never a reason to stop: a state dir that cannot be written
loses the record (said once in the log), not the run. A revert that leaves nothing else
recorded removes it (``gpunode.services.lock.tidy_state_dir``): a reverted node keeps no trace.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from gpunode import __version__
from gpunode.host.files import read_json, write_json
from gpunode.host.root import HostRoot
from gpunode.services import interrupt
from gpunode.services.lock import RUN_FILE, lock_held

log = logging.getLogger(__name__)


# What a listener is told: ("start" | "done" | "failed", the step).
Listener = Callable[[str, str], None]


def now() -> str:
    """The time as RFC 3339 in UTC, as Kubernetes writes timestamps."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class RunRecord:
    """One run as ``run.json`` holds it (camelCase: the keys ``katamgr status`` shows)."""

    command: str
    version: str
    pid: int
    started: str
    step: str | None = None  # the step under way (None: between steps)
    stepsDone: list[str] = field(default_factory=list)  # noqa: N815 - the file's key
    finished: str | None = None
    outcome: str | None = None  # "succeeded", "failed", "interrupted"; None: no end recorded
    # When the first run since the node was last fully reverted began: what katamgr
    # installed is there since then (a full revert removes this file).
    installedSince: str | None = None  # noqa: N815 - the file's key



def read_run(host: HostRoot) -> RunRecord | None:
    """The last run recorded on the node, or None (none, or a record katamgr cannot read)."""
    try:
        data = read_json(host.state_path(RUN_FILE))
        return RunRecord(**data) if isinstance(data, dict) else None
    except (ValueError, TypeError):
        return None


def interrupted(host: HostRoot, run: RunRecord) -> bool:
    """Killed part-way: no end recorded and nobody holds the node lock (a run under way
    holds it from its first step to its end; the kernel drops it when the holder dies)."""
    return run.outcome == "interrupted" or (run.finished is None and not lock_held(host))


class Journal:
    """One command's run, step by step, to ``run.json`` and to ``listener``."""

    def __init__(self, host: HostRoot | None, command: str, listener: Listener | None = None):
        self.host = host
        self.listener = listener
        self.record = RunRecord(command, __version__, os.getpid(), now())
        self._writable = host is not None
        self._recording = False  # set by the first step that writes the host

    def begin(self) -> None:
        """The run starts; nothing is written until its first step that writes the host, so a
        run that stops in its checks leaves the node as it was (the last run's record too)."""
        if self.host is not None:
            before = read_run(self.host)
            self.record.installedSince = (before.installedSince or before.started) if before else self.record.started

    @contextmanager
    def step(self, what: str, *, writes: bool = True) -> Iterator[StepOutcome]:
        """One step: said and recorded as it starts and as it ends; the caller marks a
        step that failed without raising (``outcome.failed = True``). A step that only
        reads (``writes=False``, the checks before the first write) is said, not recorded."""
        interrupt.checkpoint()  # a stop signal held back by a section that then failed: stop here
        outcome = StepOutcome()
        self._recording = self._recording or writes
        self.record.step = what
        self._save()
        self._tell("start", what)
        try:
            yield outcome
        except BaseException:
            self._tell("failed", what)
            raise
        self.record.step = None
        self.record.stepsDone.append(what)
        self._save()
        self._tell("failed" if outcome.failed else "done", what)

    def end(self, outcome: str) -> None:
        self.record.step = None if outcome == "succeeded" else self.record.step
        self.record.finished, self.record.outcome = now(), outcome
        self._save()

    def _tell(self, event: str, what: str) -> None:
        if self.listener is not None:
            self.listener(event, what)

    def _save(self) -> None:
        if not self._writable or not self._recording or self.host is None:
            return
        try:
            write_json(self.host.state_path(RUN_FILE), asdict(self.record), marked=False)
        except OSError as exc:
            self._writable = False
            log.warning("the run journal %s cannot be written (%s); katamgr status will not show "
                        "this run", self.host.host_path(self.host.state_path(RUN_FILE)), exc.strerror or exc)


@dataclass
class StepOutcome:
    failed: bool = False


def quiet() -> Journal:
    """A journal that records and says nothing: what the pipeline uses when no command asked
    for one (the agent logs its own; a fresh one each run, so nothing accumulates)."""
    return Journal(None, "")
