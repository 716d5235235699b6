"""The HTTPS server of ``katamgr webhook``: one loop thread, a few worker threads.

``POST /mutate`` and ``POST /validate`` take an AdmissionReview v1 and answer one;
``GET /healthz`` answers ``ok`` for probes (``answers``). The TLS certificate is read again
when its files change (``tls.CertReloader``).

One thread runs the serving loop the gRPC server runs too (``grpcwire.loop``: epoll over
the listening socket and every connection, accepting, the out-of-descriptors pause): it
accepts, does the TLS handshakes, reads requests and writes answers, none of it blocking
(``connection``; the HTTP/1.1 is h11's, ``httpio``). A complete review goes to a fixed pool of ``--workers`` threads,
whose answer comes back to the loop. So the threads are a fixed number whatever the
clients do, and what a client can make the server hold is bounded (``limits``):

- ``--max-connections`` open at once: the next one closes the oldest connection not being
  answered of the client address holding the most (a slow or idle one), or, when every
  connection is being answered, is itself closed at once;
- every phase of a connection has a deadline (``--request-timeout`` for handshake, head and
  body together, ``--idle-timeout`` between requests), checked by the loop;
- the bytes held for all connections (requests being read or reviewed, answers not yet
  taken) stay under ``Limits.max_buffered``: past it the largest holder not being reviewed
  is closed;
- out of file descriptors, accepting pauses (with backoff) rather than spinning.

Closed connections are tallied and logged as one line per 10 s, so a flood of clients
cannot flood the log.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import ssl
import threading
import time
from typing import Any

from gpunode.errors import ConfigError
from grpcwire.loop import ServingLoop
from katamgr.admission import answers, httpio, rules
from katamgr.admission.connection import UNANSWERED, Connection
from katamgr.admission.limits import DEFAULT, Limits
from katamgr.admission.tls import CertReloader
from katamgr.admission.workers import Workers

__all__ = ["CertReloader", "WebhookServer", "make_server", "parse_listen"]

log = logging.getLogger("katamgr.webhook")

# Accepts per loop turn (each may do a TLS handshake's crypto, about a millisecond), so that
# connections already open get their turn during a flood of new ones.
ACCEPT_BATCH = 16
# The longest the loop sleeps between deadline sweeps (a deadline may move nearer meanwhile:
# a keep-alive request's first byte).
CHECK_EVERY = 0.25
REPORT_EVERY = 10.0
FREED_WHEN_OUT_OF_FDS = 4
# How connections end every day: not news for the log.
ORDINARY = ("answered and closed", "ended by the client", "shutdown")


class WebhookServer:
    """Serve the webhook on ``address`` until ``shutdown`` (the socketserver calls, so that
    tests and the CLI drive it as they did ``ThreadingHTTPServer``)."""

    def __init__(self, address: tuple[str, int], certs: CertReloader, policy: rules.Policy,
                 limits: Limits = DEFAULT) -> None:
        self.certs, self.policy, self.limits = certs, policy, limits
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(address)
            self.socket.listen(512)
        except OSError:
            self.socket.close()
            raise
        self._loop = ServingLoop(self.socket, self, ACCEPT_BATCH)
        self._workers = Workers(limits.workers)
        self._conns: set[Connection] = set()
        self._counted: dict[Connection, int] = {}
        self.buffered = 0  # bytes the connections hold together
        # Answers from the workers: (connection, reply, error).
        self._done: collections.deque[tuple[Connection, Any, BaseException | None]] = \
            collections.deque()
        self._ready: list[Connection] = []
        # Connections ended, by why (Connection.why), since the start.
        self.ended: collections.Counter[str] = collections.Counter()
        self._reported: collections.Counter[str] = collections.Counter()
        self._next_report = time.monotonic() + REPORT_EVERY
        self._next_check = 0.0  # when the loop next looks at deadlines
        self._stopped = threading.Event()
        self._stopped.set()

    @property
    def server_address(self) -> tuple[Any, ...]:
        return self.socket.getsockname()

    @property
    def connections(self) -> int:
        return len(self._conns)

    def answer(self, path: str, request: dict[str, Any]) -> dict[str, Any]:
        """The AdmissionReview answering a parsed review's ``request``."""
        return answers.judge(path, request, self.policy)

    # The loop

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Serve until ``shutdown`` (``poll_interval``: socketserver's; the loop sleeps until
        its next deadline or event, and ``shutdown`` wakes it)."""
        self._stopped.clear()
        try:
            self._next_check = 0.0
            self._loop.run()
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop serve_forever (from another thread) and wait until it has."""
        self._loop.stop()
        self._stopped.wait()

    def server_close(self) -> None:
        self._loop.stopping = True
        for conn in list(self._conns):
            conn.close("shutdown")
        self._conns.clear()
        self._workers.stop()
        self._loop.close()

    # What the serving loop calls

    def event(self, conn: Connection, readable: bool, writable: bool) -> None:
        self._step(conn)

    def turn(self, now: float) -> float | None:
        """After the events: the workers' answers, connections with more to do, deadlines."""
        self._collect_answers()
        ready, self._ready = self._ready, []
        for conn in ready:
            if not conn.closed:
                self._step(conn)
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = self._sweep(now)
        return 0.0 if self._ready else max(0.0, self._next_check - time.monotonic())

    def _step(self, conn: Connection) -> None:
        try:
            conn.step(time.monotonic())
        except Exception:  # noqa: BLE001 - a bug with one client ends that connection only
            log.exception("error serving %s", conn.peer)
            conn.close("closed on an error")
        self._sync(conn)

    def _sync(self, conn: Connection) -> None:
        """Bring the selector, the byte count and the workers up to date with ``conn``."""
        if conn.closed:
            self._forget(conn)
            return
        held = conn.held
        self.buffered += held - self._counted.get(conn, 0)
        self._counted[conn] = held
        if conn.job is not None and not conn.queued:
            conn.queued = True
            # The queue holds the connection, not the body: a body shed while it waits is
            # let go at once (Connection.close).
            self._workers.submit(conn.job_bytes, lambda c=conn: self._review(c),
                                 lambda reply, error, c=conn: self._answered(c, reply, error))
        events = conn.wants()
        # Not watched at all while a worker has it: epoll reports a hang-up even to a
        # socket watched for nothing, which would spin the loop until the answer.
        if conn.fd not in self._loop.watched:
            if events:
                self._loop.watch(conn.fd, conn, events)
        elif not events:
            self._loop.forget(conn.fd)
        else:
            self._loop.modify(conn.fd, events)
        if conn.ready:
            self._ready.append(conn)
        if self.buffered > self.limits.max_buffered:
            self._shed_bytes()

    def _forget(self, conn: Connection) -> None:
        """A closed connection: nothing of it is kept (it may be forgotten twice, closed
        while an event of it waited in the same turn)."""
        self.buffered -= self._counted.pop(conn, 0)
        if self._loop.watched.get(conn.fd) is conn:
            self._loop.forget(conn.fd)
        if conn in self._conns:
            self._conns.remove(conn)
            self.ended[conn.why] += 1

    # Accepting

    def accepted(self, sock: socket.socket, address: Any) -> None:
        peer = str(address[0])
        if len(self._conns) >= self.limits.max_connections:
            victim = self._victim_for_room(peer)
            if victim is None:  # every connection is being answered
                sock.close()
                self.ended["refused at --max-connections"] += 1
                return
            victim.close("closed to make room")
            self._sync(victim)
        try:
            sock.setblocking(False)
            # An answer goes out as TLS records of up to 16 KiB: without this, Nagle can
            # hold the last, small one back until the client's delayed ACK (40 ms).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tls = self.certs.current().wrap_socket(sock, server_side=True,
                                                   do_handshake_on_connect=False)
        except (OSError, ssl.SSLError, ConfigError) as exc:
            log.debug("cannot set up a connection from %s: %s", peer, exc)
            sock.close()
            return
        conn = Connection(tls, peer, self.limits, time.monotonic())
        self._conns.add(conn)
        self._step(conn)  # the ClientHello is often there already

    def accept_failed(self, exc: OSError) -> None:
        log.warning("accept failed: %s", exc)

    def _victim_for_room(self, newcomer: str) -> Connection | None:
        """The oldest connection not being answered of the address that holds the most (the
        newcomer counted): whoever opens many connections and leaves them waiting loses its
        own first."""
        per_peer = collections.Counter(c.peer for c in self._conns)
        per_peer[newcomer] += 1
        candidates = [c for c in self._conns if c.state in UNANSWERED]
        if not candidates:
            return None
        return max(candidates, key=lambda c: (per_peer[c.peer], -c.since))

    def out_of_fds(self, exc: OSError, backoff: float) -> None:
        # The loop pauses accepting; close the oldest waiting connections to free
        # descriptors for those queued behind them.
        self.ended["accepting paused, out of file descriptors"] += 1
        for _ in range(FREED_WHEN_OUT_OF_FDS):
            victim = self._victim_for_room("")
            if victim is None:
                break
            victim.close("closed to make room")
            self._sync(victim)
        log.debug("cannot accept (%s): pausing %.2f s", exc.strerror, backoff)

    # Workers

    def _review(self, conn: Connection) -> httpio.Reply | None:
        """In a worker thread: the answer to the connection's review."""
        job = conn.take_job()
        if job is None:
            return None  # closed while it waited
        return answers.review_answer(*job, self.policy)

    def _answered(self, conn: Connection, reply: Any, error: BaseException | None) -> None:
        """In the worker thread: hand the answer to the loop."""
        self._done.append((conn, reply, error))
        self._wake()

    def _wake(self) -> None:
        self._loop.wake()

    def _collect_answers(self) -> None:
        while self._done:
            conn, reply, error = self._done.popleft()
            if conn.closed:
                continue
            if error is not None:  # a bug (or MemoryError) in one review answers that review
                log.error("error reviewing a request from %s: %s", conn.peer, error, exc_info=error)
                reply = httpio.error(500, f"katamgr webhook failed on this request: "
                                          f"{httpio.shorten(str(error))}")
            try:
                conn.finish(reply, time.monotonic())
            except Exception:  # noqa: BLE001
                log.exception("error answering %s", conn.peer)
                conn.close("closed on an error")
            self._sync(conn)

    # Bounds

    def _shed_bytes(self) -> None:
        """Over the byte budget: close the largest holders whose bytes can be let go (all
        but the reviews a worker is doing: a body still queued can)."""
        while self.buffered > self.limits.max_buffered:
            holders = [c for c in self._conns if not c.closed and not c.running and c.held]
            if not holders:
                return
            victim = max(holders, key=lambda c: c.held)
            victim.close("closed over the byte budget")
            self._sync(victim)

    def _sweep(self, now: float) -> float:
        """Close the connections past their deadline; when to sweep next."""
        for conn in [c for c in self._conns if now >= c.deadline]:
            conn.expire(now)
            self._sync(conn)
        if now >= self._next_report:
            self._next_report = now + REPORT_EVERY
            self._report()
        return min([now + CHECK_EVERY, *(c.deadline for c in self._conns)])

    def _report(self) -> None:
        # Closes that say something about the clients; ends of ordinary requests are not news.
        news = {why: n - self._reported[why] for why, n in self.ended.items()
                if why not in ORDINARY and n > self._reported[why]}
        self._reported.update(news)
        if news:
            log.warning("in the last %.0f s: %s (%d connections open, max %d; request timeout "
                        "%g s)", REPORT_EVERY, ", ".join(f"{n} {why}" for why, n in
                                                         sorted(news.items())),
                        len(self._conns), self.limits.max_connections, self.limits.request_timeout)


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--listen {listen!r} is not HOST:PORT (e.g. 0.0.0.0:8443 or [::]:8443)")
    return host.strip("[]") or "0.0.0.0", int(port)


def make_server(listen: str, cert_file: str | os.PathLike, key_file: str | os.PathLike,
                policy: rules.Policy, limits: Limits = DEFAULT) -> WebhookServer:
    certs = CertReloader(cert_file, key_file)
    try:
        return WebhookServer(parse_listen(listen), certs, policy, limits)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {listen}: {exc}") from None
