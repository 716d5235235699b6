"""The serving loop both our servers run: one thread, epoll over a listening socket, a
wake-up pipe and every connection, the protocol left to its owner.

The gRPC server (``grpcwire.server``, h2 over a unix socket) and the admission webhook
(``katamgr.admission.server``, h11 over TLS) bring their own connections; what they share
is here: accepting (a batch per turn, so that open connections get their turn during a
flood of new ones), pausing with backoff when the process is out of file descriptors (the
listener stays readable while accept fails, so accepting on would spin), waking the loop
from another thread, and a turn's order: events, then the owner's turn (answers from other
threads, deadlines), then the next wait, as long as the owner asks.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import threading
import time
from typing import Any, Protocol

READ = select.EPOLLIN
WRITE = select.EPOLLOUT
# A hang-up or error is read as input: the read then finds the end or the error.
READABLE = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class Owner(Protocol):
    """A server as the loop sees it: its connections, by file descriptor."""

    def accepted(self, sock: socket.socket, address: Any) -> None:
        """A new connection (blocking still): set it up and ``watch`` it, or close it."""

    def event(self, connection: Any, readable: bool, writable: bool) -> None:
        """A watched connection's socket is ready."""

    def turn(self, now: float) -> float | None:
        """After each turn's events: work handed over from other threads, deadlines. How
        long the loop may wait for events before the next turn (0: at once, None: only
        for events)."""

    def accept_failed(self, exc: OSError) -> None:
        """Accepting failed for another reason (the loop goes on)."""

    def out_of_fds(self, exc: OSError, backoff: float) -> None:
        """Accepting failed for want of descriptors and pauses ``backoff`` seconds: free some."""


class ServingLoop:
    def __init__(self, listener: socket.socket, owner: Owner, accept_batch: int = 64) -> None:
        listener.setblocking(False)
        self.listener, self.owner, self.accept_batch = listener, owner, accept_batch
        self.watched: dict[int, Any] = {}  # connections by file descriptor
        self._events: dict[int, int] = {}
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(listener.fileno(), READ)
        self._epoll.register(self._wake_r, READ)
        self.stopping = False
        self._backoff = 0.0
        self.paused_until: float | None = None  # accepting, when out of file descriptors

    # -- the owner's connections ---------------------------------------------------

    def watch(self, fd: int, connection: Any, events: int) -> None:
        self.watched[fd] = connection
        self._events[fd] = events
        self._epoll.register(fd, events)

    def modify(self, fd: int, events: int) -> None:
        """Wait for ``events`` on a watched connection (0: for nothing, a worker has it)."""
        if self._events.get(fd, events) != events:
            self._events[fd] = events
            try:
                self._epoll.modify(fd, events)
            except (ValueError, OSError):
                pass  # closed meanwhile

    def forget(self, fd: int) -> Any:
        """Stop watching a connection (closed, or about to be); None when it was not."""
        connection = self.watched.pop(fd, None)
        if connection is not None:
            del self._events[fd]
            try:
                self._epoll.unregister(fd)
            except (ValueError, OSError):
                pass  # its socket is closed: epoll dropped it already
        return connection

    # -- from any thread ----------------------------------------------------------

    def wake(self) -> None:
        # Under the lock, as ``close`` closes the pipe under it: a number written to after
        # its close may belong to any file or socket the process opened since.
        with self._lock:
            if self._wake_w < 0:
                return
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass  # a wake-up is pending already

    def stop(self) -> None:
        self.stopping = True
        self.wake()

    # -- the loop -------------------------------------------------------------------

    def run(self) -> None:
        """Serve until ``stop``; what the owner raises ends the loop (``close`` after)."""
        owner, epoll, watched = self.owner, self._epoll, self.watched
        listening, waking = self.listener.fileno(), self._wake_r
        timeout: float | None = 0.0
        while not self.stopping:
            wait = -1.0 if timeout is None else timeout
            if self.paused_until is not None:
                until = max(0.0, self.paused_until - time.monotonic())
                wait = until if wait < 0 else min(wait, until)
            for fd, events in epoll.poll(wait):
                connection = watched.get(fd)
                if connection is not None:
                    owner.event(connection, bool(events & READABLE), bool(events & WRITE))
                elif fd == listening:
                    self._accept()
                elif fd == waking:
                    _drain(waking)
            now = time.monotonic()
            if self.paused_until is not None and now >= self.paused_until:
                self.paused_until = None
                epoll.register(listening, READ)
            timeout = owner.turn(now)

    def _accept(self) -> None:
        for _ in range(self.accept_batch):
            try:
                sock, address = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno not in OUT_OF_FDS:
                    self.owner.accept_failed(exc)
                    return
                self._backoff = min(1.0, max(0.01, self._backoff * 2))
                self.paused_until = time.monotonic() + self._backoff
                self._epoll.unregister(self.listener.fileno())
                self.owner.out_of_fds(exc, self._backoff)
                return
            self._backoff = 0.0
            self.owner.accepted(sock, address)

    def close(self) -> None:
        """Let go of the epoll, the listener and the pipe (the connections are the owner's)."""
        self._epoll.close()
        self.listener.close()
        with self._lock:
            pipe, (self._wake_r, self._wake_w) = (self._wake_r, self._wake_w), (-1, -1)
        for fd in pipe:
            try:
                os.close(fd)
            except OSError:
                pass


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
