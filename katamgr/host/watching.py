"""Waiting for file changes without polling, and waking the waiter from another thread.

Every long-running loop of this project waits the same way: ``katamgr run``
(containerd's config dir), the device plugin's device watcher (``/dev/vfio``,
sysfs) and each plugin server's supervisor (the kubelet's socket dir). Each one
``select``s on an inotify descriptor and on the read end of a pipe that
``wake()`` writes to (a stop request, or a hint to look again), with a timeout
as the safety net for events that never come: inotify events are only a hint,
and the loops decide from the state of the files. ``Watcher`` is that wait.
"""

from __future__ import annotations

import os
import select
import threading
import time
from pathlib import Path

from inotify_simple import INotify


class Watcher:
    """inotify watches plus a wake pipe; ``close()`` when done."""

    def __init__(self) -> None:
        self._inotify = INotify()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()
        self._closed = False

    def add_watch(self, path: Path, mask: int) -> int:
        """Watch ``path`` for the events in ``mask``; the watch descriptor. Raises OSError."""
        return self._inotify.add_watch(path, mask)

    def wait(self, timeout: float | None) -> list | None:
        """Block until inotify events arrive, ``wake()`` is called or ``timeout`` s pass.

        Returns the events read (an empty list on timeout), or None when woken.
        """
        ready, _, _ = select.select([self._inotify.fileno(), self._wake_r], [], [], timeout)
        if self._wake_r in ready:
            self._drain_wake()
            return None
        if ready:
            return self._inotify.read(timeout=0)
        return []

    def settle(self, quiet: float, limit: float) -> list:
        """The rest of a burst of events: read until ``quiet`` s pass without one,
        for at most ``limit`` s (one bind is several events; one look covers them all)."""
        events: list = []
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if not select.select([self._inotify.fileno()], [], [], quiet)[0]:
                break
            events += self._inotify.read(timeout=0)
        return events

    def wake(self) -> None:
        """Make a ``wait()`` in another thread return None now (or the next one, if none waits)."""
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._inotify.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
