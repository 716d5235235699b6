"""Waiting for file changes without polling, and waking the waiter from another thread.

Every long-running loop of this project waits the same way: ``katamgr run``
(containerd's config dir), the device plugin's device watcher (``/dev/vfio``,
sysfs) and each plugin server's supervisor (the kubelet's socket dir). Each one
``select``s on an inotify descriptor and on the read end of a pipe that
``wake()`` writes to (a stop request, or a hint to look again), with a timeout
as the safety net for events that never come: inotify events are only a hint,
and the loops decide from the state of the files. ``Watcher`` is that wait.
Other event sources (the kernel's uevent socket) join the same ``select`` with
``add_source``.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable
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
        self._sources: dict[int, Callable[[], list]] = {}

    def add_watch(self, path: Path, mask: int) -> int:
        """Watch ``path`` for the events in ``mask``; the watch descriptor. Raises OSError."""
        return self._inotify.add_watch(path, mask)

    def add_source(self, fd: int, read: Callable[[], list]) -> None:
        """Wait on ``fd`` too; when it is readable ``read()`` drains it and what it
        returns joins the events (an empty list: nothing of interest)."""
        self._sources[fd] = read

    def remove_source(self, fd: int) -> None:
        """Wait on ``fd`` no more (before it is closed: a closed number may name another file).
        Called from the waiting thread, a source's ``read`` too (which runs under the lock)."""
        self._sources.pop(fd, None)

    def wait(self, timeout: float | None) -> list | None:
        """Block until events arrive, ``wake()`` is called or ``timeout`` s pass.

        Returns the events read (an empty list on timeout, or when a source had
        nothing of interest), or None when woken or closed.
        """
        fds = self._fds()
        if fds is None:
            return None
        ready, _, _ = select.select(fds, [], [], timeout)
        # Read only while not closed: a stop that gave up waiting for this thread may
        # close() meanwhile, and the numbers may then name another file or socket.
        with self._lock:
            if self._closed:
                return None
            if self._wake_r in ready:
                self._drain_wake()
                return None
            return self._read(ready)

    def settle(self, quiet: float, limit: float) -> list:
        """The rest of a burst of events: read until ``quiet`` s pass without one,
        for at most ``limit`` s (one bind is several events; one look covers them all)."""
        events: list = []
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            fds = self._fds(wake=False)
            if fds is None:
                break
            ready = select.select(fds, [], [], quiet)[0]
            if not ready:
                break
            with self._lock:
                if self._closed:
                    break
                events += self._read(ready)
        return events

    def _fds(self, wake: bool = True) -> list[int] | None:
        with self._lock:
            if self._closed:
                return None
            return [self._inotify.fileno(), *([self._wake_r] if wake else []), *list(self._sources)]

    def _read(self, ready: list[int]) -> list:
        events: list = []
        if self._inotify.fileno() in ready:
            events += self._inotify.read(timeout=0)
        for fd in ready:
            read = self._sources.get(fd)
            if read is not None:
                events += read()
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
