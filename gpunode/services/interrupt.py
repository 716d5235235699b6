"""Ctrl-C (SIGINT) and SIGTERM for a command that changes the node: stop at the next safe
point, never half-way through a change that must be whole.

Python turns SIGINT into KeyboardInterrupt and lets SIGTERM kill the process (exit 143,
nothing said). A command that changes the host runs in ``handled()``: both signals then
raise ``Interrupted`` in the main thread, at once where that is safe (waiting for a lock or
a download, between IOMMU groups or steps) and at the end of the section where it is not
(``deferred()``: one IOMMU group's bind with its rollback, containerd's config and its
reload). The command catches it, lists what was done and names the revert, and exits
128 + the signal's number, as a shell reports a process a signal stopped.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from gpunode.services.process import STOP_SIGNALS

_depth = 0  # deferred() sections the main thread is in
_pending: int | None = None  # the signal that arrived inside one


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived; ``exit_code`` is 128 + its number (130 SIGINT, 143 SIGTERM)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _handler(signum: int, _frame: object) -> None:
    global _pending
    if _depth:
        _pending = _pending or signum
        return
    raise Interrupted(signum)


@contextmanager
def handled() -> Iterator[bool]:
    """Within the block, SIGINT and SIGTERM raise ``Interrupted`` (the main thread only:
    Python runs signal handlers there; elsewhere nothing is installed and False is given);
    the handlers before it are put back after it (a test calling ``main`` keeps its own)."""
    global _pending
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    before = {signum: signal.signal(signum, _handler) for signum in STOP_SIGNALS}
    _pending = None
    try:
        yield True
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def checkpoint() -> None:
    """A safe point: raise the stop signal that arrived during a ``deferred()`` section."""
    global _pending
    if _pending is not None and not _depth:
        signum, _pending = _pending, None
        raise Interrupted(signum)


@contextmanager
def deferred() -> Iterator[None]:
    """A section a stop signal must not cut: one arriving inside is raised at its end."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only: nothing to hold back here
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
    checkpoint()
