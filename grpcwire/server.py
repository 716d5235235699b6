"""A gRPC server on a unix socket: one thread, an epoll loop, the handlers called inline.

Why not grpcio's server: on the device plugin's calls its Python server spends
300-400 us of CPU and two thread hand-offs per call before our handler runs, and
loading it costs 17 MiB and a handful of threads; 20 half-open calls stall it
whole. What the kubelet needs is small: unary calls and one server-streaming call
(ListAndWatch), uncompressed, in cleartext HTTP/2 with prior knowledge.

The loop reads each ready connection once per turn (so one busy client cannot
starve the others), hands the bytes to its ``ServerConnection`` (h2 underneath)
and runs the handler of every call whose request is complete; every handler here
answers from memory or a few sysfs reads. Once a second it looks at the clock's
limits (request deadlines, stalled output, idle connections). When the process
runs out of file descriptors it stops accepting for a while, backing off, and
closes the least recently active connection of the process holding the most.

A failure of the loop itself ends the server (``alive`` turns False) and calls
``on_failure``, whose owner serves again (``sandbox_plugin.served``); a failure
while handling one connection closes that connection only.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping

from grpcwire import limits as _limits
from grpcwire.connection import ServerConnection, ServerStream
from grpcwire.guards import Budget, QuietLog
from grpcwire.limits import Limits, shorten
from grpcwire.protocol import Call, Held
from grpcwire.status import RpcError, StatusCode, split_messages

log = logging.getLogger(__name__)

Unary = Callable[[bytes], bytes]
Streaming = Callable[[bytes, ServerStream], None]

# Read per connection per turn: at most a few dozen small calls, so that one busy client
# holds the others up by a few milliseconds at most.
_READ = 4096
_TICK = 1.0
_TICK_BATCH = 4
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


class GrpcServer:
    """Serve ``unary`` and ``streaming`` handlers (by ``/package.Service/Method``) on a unix socket.

    A handler gets the request message's bytes. A unary handler returns the
    answer's bytes; a streaming one gets a ``ServerStream`` too and returns at
    once, sending on the stream as long as it likes. Either raises ``RpcError``
    to end the call with that status.
    """

    def __init__(self, path: str, unary: Mapping[str, Unary],
                 streaming: Mapping[str, Streaming] | None = None, *, name: str = "grpc",
                 limits: Limits | None = None, on_failure: Callable[[], None] | None = None) -> None:
        self.path = path
        self.name = name
        self.limits = limits or _limits.DEFAULT
        self.on_failure = on_failure
        self.quiet = QuietLog(log)
        self.held = Held()  # request bytes held by all connections (their loop thread counts)
        self.failure: str | None = None
        self._unary = {k.encode(): v for k, v in unary.items()}
        self._streaming = {k.encode(): v for k, v in (streaming or {}).items()}
        self._epoll: select.epoll | None = None
        self._listener: socket.socket | None = None
        self._connections: dict[int, ServerConnection] = {}  # by fd
        self._budgets: dict[int, Budget] = {}  # by client process
        self._lock = threading.Lock()
        self._want_write: set[ServerConnection] = set()
        self._want_close: set[ServerConnection] = set()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._wake_r = self._wake_w = -1
        self._accept_backoff = 0.0
        self._accepting_at: float | None = None  # paused until then

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    def start(self) -> None:
        """Listen on the socket (OSError when it cannot) and serve from a new thread."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.path)
            listener.listen(socket.SOMAXCONN)
        except OSError:
            listener.close()
            raise
        listener.setblocking(False)
        self._listener = listener
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(listener.fileno(), select.EPOLLIN)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """End every call and connection (streams with OK) and stop listening; the socket
        file stays for the caller to remove."""
        with self._lock:
            self._stopping = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- from any thread ----------------------------------------------------------

    def want_write(self, connection: ServerConnection) -> None:
        with self._lock:
            self._want_write.add(connection)
        self._wake()

    def want_close(self, connection: ServerConnection) -> None:
        with self._lock:
            self._want_close.add(connection)
        self._wake()

    def _wake(self) -> None:
        # Under the lock, as the loop closes the pipe under it: a number written to after
        # its close may belong to any file or socket the process opened since.
        with self._lock:
            if self._wake_w < 0:
                return  # the loop is gone
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass  # a wake-up is pending already

    # -- the loop -------------------------------------------------------------------

    def _run(self) -> None:
        epoll = self._epoll
        listener = self._listener
        assert epoll is not None and listener is not None
        connections = self._connections
        listening, waking = listener.fileno(), self._wake_r
        readable = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
        next_tick = time.monotonic() + _TICK
        ticking: list[ServerConnection] = []  # still to look at this second
        try:
            while not self._stopping:
                timeout = -1.0
                if ticking:
                    timeout = 0.0
                elif connections or self._accepting_at is not None:
                    timeout = max(0.0, min(next_tick, self._accepting_at or next_tick) - time.monotonic())
                for fd, events in epoll.poll(timeout):
                    connection = connections.get(fd)
                    if connection is not None:
                        self._serve(connection, events & readable, events & select.EPOLLOUT)
                    elif fd == listening:
                        self._accept()
                    elif fd == waking:
                        _drain(waking)
                self._service()
                now = time.monotonic()
                if self._accepting_at is not None and now >= self._accepting_at:
                    self._accepting_at = None
                    epoll.register(listening, select.EPOLLIN)
                if now >= next_tick:
                    next_tick = now + _TICK
                    ticking = list(connections.values())
                    self._forget_budgets()
                if ticking:
                    # A few connections a turn: thousands of calls past their deadline at
                    # once must not hold up the answers to everyone else.
                    batch, ticking = ticking[:_TICK_BATCH], ticking[_TICK_BATCH:]
                    for connection in batch:
                        if connections.get(connection.fd) is connection:
                            self._guarded(connection, connection.tick, now)
                    self._service()
        except BaseException as exc:  # MemoryError included: the owner must know
            self.failure = f"{type(exc).__name__}: {exc}"
            log.exception("%s: the gRPC loop failed; closing its connections", self.name)
        finally:
            self._shutdown()
        if self.failure is not None and self.on_failure is not None:
            self.on_failure()

    def _serve(self, connection: ServerConnection, readable: int, writable: int) -> None:
        if readable and not connection.backlogged:
            try:
                data = connection.sock.recv(_READ)
            except BlockingIOError:
                data = None
            except OSError:
                data = b""
            if data == b"":
                connection.broken = True
                self._drop(connection, goodbye=False)
                return
            if data:
                ready = self._guarded(connection, connection.received, data)
                for call in ready or ():
                    self._dispatch(connection, call)
        if writable:
            connection.on_writable()
        if self._connections.get(connection.fd) is connection:
            self._rearm(connection)

    def _rearm(self, connection: ServerConnection) -> None:
        """Watch for what the connection waits on: input unless its output is backed up,
        writability while output waits."""
        events = (0 if connection.backlogged else select.EPOLLIN) | (select.EPOLLOUT if connection.out else 0)
        if events != connection.events:
            connection.events = events
            assert self._epoll is not None
            try:
                self._epoll.modify(connection.fd, events)
            except (ValueError, OSError):
                pass  # closed meanwhile

    def _guarded(self, connection: ServerConnection, step, *args):
        """Run one connection's step; a failure closes that connection, not the loop."""
        try:
            return step(*args)
        except Exception as exc:
            self.quiet.warning("failed", "%s: closing a connection (pid %d) after an error: %s",
                               self.name, connection.peer, shorten(f"{type(exc).__name__}: {exc}"))
            self._drop(connection, goodbye=False)
            return None

    def _service(self) -> None:
        if not (self._want_write or self._want_close):
            return  # the usual case: every answer went out whole
        with self._lock:
            writers, self._want_write = self._want_write, set()
            closing, self._want_close = self._want_close, set()
        for connection in closing:
            self._drop(connection, goodbye=False)
        for connection in writers:
            if self._connections.get(connection.fd) is connection:
                connection.on_writable()
                self._rearm(connection)

    def _accept(self) -> None:
        assert self._listener is not None and self._epoll is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_FDS:
                    self._pause_accepting(exc)
                else:
                    self.quiet.warning("accept", "%s: accept failed: %s", self.name, exc)
                return
            self._accept_backoff = 0.0
            try:
                peer = _PEERCRED.unpack(sock.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[0]
                sock.setblocking(False)
                if len(self._connections) >= self.limits.max_connections and not self._make_room(peer):
                    self.quiet.warning("connections", "%s: refusing a connection from pid %d: %d "
                                       "connections are open, one from each process", self.name,
                                       peer, len(self._connections))
                    sock.close()
                    continue
                budget = self._budgets.get(peer)
                if budget is None:
                    budget = self._budgets[peer] = Budget(self.limits.flood_burst, self.limits.flood_rate)
                connection = ServerConnection(self, sock, peer, budget)
            except OSError as exc:
                sock.close()
                self.quiet.warning("accept", "%s: could not set up a connection: %s", self.name, exc)
                continue
            if budget.overdrawn:  # it flooded us and has not earned its way back
                with connection.lock:
                    connection.calm("too many frames that do no work; wait before connecting again")
                connection.close(goodbye=False)
                continue
            self._connections[connection.fd] = connection
            connection.events = select.EPOLLIN
            self._epoll.register(connection.fd, select.EPOLLIN)

    def _pause_accepting(self, exc: OSError) -> None:
        """Out of file descriptors: stop accepting for a while (the listener stays readable,
        so accepting on would spin), and free one if a process holds several."""
        assert self._listener is not None and self._epoll is not None
        self._accept_backoff = min(1.0, max(0.01, self._accept_backoff * 2))
        self._accepting_at = time.monotonic() + self._accept_backoff
        self._epoll.unregister(self._listener.fileno())
        self.quiet.warning("fds", "%s: cannot accept a connection (%s); pausing %.2f s, %d "
                           "connections open", self.name, exc.strerror, self._accept_backoff,
                           len(self._connections))
        self._make_room(None)

    def _make_room(self, newcomer: int | None) -> bool:
        """Close the least recently active connection of the process holding the most (the
        newcomer's counted), if that process holds more than one; False when none does."""
        by_peer: dict[int, list[ServerConnection]] = {}
        for connection in self._connections.values():
            by_peer.setdefault(connection.peer, []).append(connection)
        if not by_peer:
            return False
        peer, held = max(by_peer.items(), key=lambda item: len(item[1]) + (item[0] == newcomer))
        if len(held) + (peer == newcomer) < 2:
            return False
        victim = min(held, key=lambda c: c.active_at)
        with victim.lock:
            victim.calm(f"too many connections from process {peer}")
        self._drop(victim, goodbye=False)
        return True

    def _forget_budgets(self) -> None:
        """Budgets of processes with no connection left that are full again."""
        held = {connection.peer for connection in self._connections.values()}
        for peer in [p for p, b in self._budgets.items() if p not in held and b.full]:
            del self._budgets[peer]

    def _drop(self, connection: ServerConnection, goodbye: bool) -> None:
        if self._connections.get(connection.fd) is not connection:
            return  # gone already (its number may be another connection's by now)
        del self._connections[connection.fd]
        assert self._epoll is not None
        try:
            self._epoll.unregister(connection.fd)
        except (ValueError, OSError):
            pass
        connection.close(goodbye)

    def _shutdown(self) -> None:
        for connection in list(self._connections.values()):
            try:
                self._drop(connection, goodbye=self.failure is None)
            except Exception:  # noqa: S110 (closing the rest matters more)
                pass
        if self._epoll is not None:
            self._epoll.close()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            pipe, (self._wake_r, self._wake_w) = (self._wake_r, self._wake_w), (-1, -1)
        for fd in pipe:
            try:
                os.close(fd)
            except OSError:
                pass

    def _dispatch(self, connection: ServerConnection, call: Call) -> None:
        """Run the handler of a call whose request is complete (on the loop thread)."""
        request = connection.take_request(call)
        try:
            messages = split_messages(request)
            if len(messages) != 1:
                raise RpcError(StatusCode.INTERNAL, f"expected one request message, got {len(messages)}")
            unary = self._unary.get(call.path)
            if unary is not None:
                connection.respond(call, unary(messages[0]))
                return
            streaming = self._streaming.get(call.path)
            if streaming is None:
                raise RpcError(StatusCode.UNIMPLEMENTED,
                               f"unknown method {shorten(call.path.decode(errors='replace'), 100)}")
            streaming(messages[0], ServerStream(connection, call))
        except RpcError as exc:
            connection.fail(call, exc.code, exc.details)
        except Exception as exc:
            log.exception("%s: %s failed", self.name, shorten(call.path.decode(errors="replace"), 100))
            connection.fail(call, StatusCode.UNKNOWN, f"Exception calling application: {exc}")


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
