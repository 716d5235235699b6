"""A gRPC server on a unix socket: one thread, an epoll loop, the handlers called inline.

Why not grpcio's server: on the device plugin's calls its Python server spends
300-400 us of CPU and two thread hand-offs per call before our handler runs, and
loading it costs 17 MiB and a handful of threads; 20 half-open calls stall it
whole. What the kubelet needs is small: unary calls and one server-streaming call
(ListAndWatch), uncompressed, in cleartext HTTP/2 with prior knowledge.

The loop (``grpcwire.loop``, shared with the admission webhook: accepting, the
out-of-descriptors pause, waking) reads each ready connection once per turn (so one busy
client cannot starve the others), hands the bytes to its ``ServerConnection`` (h2
underneath) and runs the handler of every call whose request is complete; every handler
here answers from memory or a few sysfs reads. Once a second it looks at the clock's
limits (request deadlines, stalled output, idle connections). When the process runs out
of file descriptors it stops accepting for a while, backing off, and closes the least
recently active connection of the process holding the most.

A failure of the loop itself ends the server (``alive`` turns False) and calls
``on_failure``, whose owner serves again (``sandbox_plugin.served``); a failure
while handling one connection closes that connection only.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping

from grpcwire import limits as _limits
from grpcwire.connection import ServerConnection, ServerStream
from grpcwire.guards import Budget, QuietLog
from grpcwire.limits import Limits, shorten
from grpcwire.loop import READ, WRITE, ServingLoop
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
# A unix socket's connection costs no handshake: take every one waiting.
_ACCEPT_BATCH = 1024
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
        self._loop: ServingLoop | None = None
        self._connections: dict[int, ServerConnection] = {}  # by fd: the loop's
        self._budgets: dict[int, Budget] = {}  # by client process
        self._lock = threading.Lock()
        self._want_write: set[ServerConnection] = set()
        self._want_close: set[ServerConnection] = set()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._next_tick = 0.0
        self._ticking: list[ServerConnection] = []  # still to look at this second

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
        self._loop = ServingLoop(listener, self, _ACCEPT_BATCH)
        self._connections = self._loop.watched
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """End every call and connection (streams with OK) and stop listening; the socket
        file stays for the caller to remove."""
        with self._lock:
            self._stopping = True
        if self._loop is not None:
            self._loop.stop()
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
        if self._loop is not None:
            self._loop.wake()

    # -- the loop (ServingLoop calls) ----------------------------------------------------

    def _run(self) -> None:
        loop = self._loop
        assert loop is not None
        self._next_tick = time.monotonic() + _TICK
        try:
            if not self._stopping:
                loop.run()
        except BaseException as exc:  # MemoryError included: the owner must know
            self.failure = f"{type(exc).__name__}: {exc}"
            log.exception("%s: the gRPC loop failed; closing its connections", self.name)
        finally:
            self._shutdown()
        if self.failure is not None and self.on_failure is not None:
            self.on_failure()

    def event(self, connection: ServerConnection, readable: bool, writable: bool) -> None:
        self._serve(connection, readable, writable)

    def turn(self, now: float) -> float | None:
        connections = self._connections
        self._service()
        if now >= self._next_tick:
            self._next_tick = now + _TICK
            self._ticking = list(connections.values())
            self._forget_budgets()
        if self._ticking:
            # A few connections a turn: thousands of calls past their deadline at once
            # must not hold up the answers to everyone else.
            batch, self._ticking = self._ticking[:_TICK_BATCH], self._ticking[_TICK_BATCH:]
            for connection in batch:
                if connections.get(connection.fd) is connection:
                    self._guarded(connection, connection.tick, now)
            self._service()
        if self._ticking:
            return 0.0
        if connections:
            return max(0.0, self._next_tick - time.monotonic())
        return None

    def _serve(self, connection: ServerConnection, readable: bool, writable: bool) -> None:
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
        assert self._loop is not None
        self._loop.modify(connection.fd, (0 if connection.backlogged else READ) | (WRITE if connection.out else 0))

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

    def accepted(self, sock: socket.socket, _address: object) -> None:
        assert self._loop is not None
        try:
            peer = _PEERCRED.unpack(sock.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[0]
            sock.setblocking(False)
            if len(self._connections) >= self.limits.max_connections and not self._make_room(peer):
                self.quiet.warning("connections", "%s: refusing a connection from pid %d: %d "
                                   "connections are open, one from each process", self.name,
                                   peer, len(self._connections))
                sock.close()
                return
            budget = self._budgets.get(peer)
            if budget is None:
                budget = self._budgets[peer] = Budget(self.limits.flood_burst, self.limits.flood_rate)
            connection = ServerConnection(self, sock, peer, budget)
        except OSError as exc:
            sock.close()
            self.quiet.warning("accept", "%s: could not set up a connection: %s", self.name, exc)
            return
        if budget.overdrawn:  # it flooded us and has not earned its way back
            with connection.lock:
                connection.calm("too many frames that do no work; wait before connecting again")
            connection.close(goodbye=False)
            return
        self._loop.watch(connection.fd, connection, READ)

    def accept_failed(self, exc: OSError) -> None:
        self.quiet.warning("accept", "%s: accept failed: %s", self.name, exc)

    def out_of_fds(self, exc: OSError, backoff: float) -> None:
        """Out of file descriptors (the loop pauses accepting): free one if a process holds
        several."""
        self.quiet.warning("fds", "%s: cannot accept a connection (%s); pausing %.2f s, %d "
                           "connections open", self.name, exc.strerror, backoff,
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
        assert self._loop is not None
        self._loop.forget(connection.fd)
        connection.close(goodbye)

    def _shutdown(self) -> None:
        for connection in list(self._connections.values()):
            try:
                self._drop(connection, goodbye=self.failure is None)
            except Exception:  # noqa: S110 (closing the rest matters more)
                pass
        if self._loop is not None:
            self._loop.close()

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

