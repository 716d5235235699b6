"""``katamgr webhook`` as its own process (as the chart runs it), what it holds (threads,
memory), and the slow TLS clients of the security review: for tests/admission/test_webhook_hostile.py
and bench/bench_webhook.py."""

from __future__ import annotations

import collections
import json
import os
import resource
import select
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from support import podkit
from support.tlskit import CA, Client, make_ca, write_server_pair

KATAMGR = str(Path(sys.executable).parent / "katamgr")
# The clocks of the webhook the tests share (conftest.py's webhook_process): short, so that
# the deadlines are seen within a test.
SHORT_REQUEST_TIMEOUT = 3.0
SHORT_IDLE_TIMEOUT = 2.0
# A slow client's request: the head stops before its end (no blank line), so the server
# waits for the rest of it.
HALF_HEAD = b"POST /mutate HTTP/1.1\r\nHost: webhook\r\nContent-Type: application/json\r\nContent-Len"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raise_fd_limit() -> None:
    """Thousands of client sockets need more than the usual soft limit of 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@dataclass
class WebhookProcess:
    process: subprocess.Popen
    port: int
    ca: CA
    log: Path
    cert: Path
    key: Path

    @classmethod
    def launch(cls, tmp: Path, *flags: str, nofile: int = 0) -> WebhookProcess:
        """``katamgr webhook`` on a free loopback port with a CA of its own, up and answering;
        ``nofile``: its file descriptor limit."""
        ca = make_ca()
        cert, key = tmp / "tls.crt", tmp / "tls.key"
        write_server_pair(ca, cert, key)
        port = free_port()
        log = tmp / "webhook.log"

        def limit() -> None:
            if nofile:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        with log.open("wb") as out:
            process = subprocess.Popen(
                [KATAMGR, "webhook", "--listen", f"127.0.0.1:{port}", "--tls-cert-file", str(cert),
                 "--tls-private-key-file", str(key), *flags],
                stdout=out, stderr=subprocess.STDOUT, preexec_fn=limit)  # noqa: S603,PLW1509
        self = cls(process, port, ca, log, cert, key)
        client, deadline = self.client(), time.monotonic() + 30
        try:
            while True:
                try:
                    if client.request("GET", "/healthz")[0] == 200:
                        break
                except OSError:
                    client.close()
                if process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise AssertionError(f"katamgr webhook did not come up:\n{self.log_text()}")
                time.sleep(0.05)
            # One review of each kind, so that the worker threads and the rules are loaded
            # before anything is measured.
            for path in ("/mutate", "/validate"):
                client.review(path, podkit.review(podkit.cases()["no-request"]))
        finally:
            client.close()
        return self

    def client(self) -> Client:
        return Client(self.port, self.ca)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def _status(self, field_name: str) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
        raise AssertionError(f"no {field_name} for pid {self.process.pid}")

    def threads(self) -> int:
        return self._status("Threads")

    def rss_mib(self) -> float:
        return self._status("VmRSS") / 1024

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


class Sampler:
    """The webhook's thread count and RSS, every 20 ms, in a thread of this process."""

    def __init__(self, webhook: WebhookProcess) -> None:
        self.webhook = webhook
        self.base_rss = webhook.rss_mib()
        self.max_rss = self.base_rss
        self.max_threads = webhook.threads()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.max_rss = max(self.max_rss, self.webhook.rss_mib())
                self.max_threads = max(self.max_threads, self.webhook.threads())
            except (OSError, AssertionError):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    @property
    def growth_mib(self) -> float:
        return self.max_rss - self.base_rss


def half_sent(port: int, context: ssl.SSLContext, head: bytes = HALF_HEAD) -> ssl.SSLSocket | None:
    """A TLS connection with its handshake done and ``head`` sent, never finished; None when
    the server closed it first (as it may, to make room)."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        tls = context.wrap_socket(raw, server_hostname="localhost")
        tls.sendall(head)
        return tls
    except OSError:
        raw.close()
        return None


@dataclass
class Attack:
    """``count`` slow clients opened one after another from ``threads`` threads, held open."""

    port: int
    context: ssl.SSLContext
    count: int
    threads: int = 4
    held: list[ssl.SSLSocket] = field(default_factory=list)
    refused: int = 0
    seconds: float = 0.0  # to open them all

    def run(self) -> Attack:
        lock = threading.Lock()
        began = time.monotonic()

        def opener(n: int) -> None:
            for _ in range(n):
                tls = half_sent(self.port, self.context)
                with lock:
                    if tls is None:
                        self.refused += 1
                    else:
                        self.held.append(tls)

        shares = [self.count // self.threads + (i < self.count % self.threads) for i in range(self.threads)]
        workers = [threading.Thread(target=opener, args=(n,)) for n in shares]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        self.seconds = time.monotonic() - began
        return self

    def outcome(self, wait: float = 0.5) -> collections.Counter[str]:
        """How the held connections stand after ``wait`` s: "open" (the server still waits
        for them), "408" (cut off at the deadline, told so), "closed" (closed without a word,
        to make room for a newer connection)."""
        time.sleep(wait)
        poller = select.poll()
        for tls in self.held:
            poller.register(tls, select.POLLIN | select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        ready = {fd for fd, _ in poller.poll(0)}
        out: collections.Counter[str] = collections.Counter()
        for tls in self.held:
            if tls.fileno() not in ready:
                out["open"] += 1
                continue
            tls.setblocking(False)
            try:
                got = tls.recv(4096)
            except ssl.SSLWantReadError:  # only TLS's own records (session tickets): open
                out["open"] += 1
                continue
            except OSError:
                got = b""
            out["408" if got.startswith(b"HTTP/1.1 408") else "closed"] += 1
        return out

    def still_open(self, wait: float = 0.5) -> int:
        return self.outcome(wait)["open"]

    def close(self) -> None:
        for tls in self.held:
            tls.close()


class Reviewer:
    """A well-behaved client sending a review every ``period`` s on a new connection each
    time (the TLS handshake inside the flood), timing each answer."""

    def __init__(self, webhook: WebhookProcess, period: float = 0.1) -> None:
        self.webhook, self.period = webhook, period
        self.body = json.dumps(podkit.review(podkit.cases()["passthrough-none"])).encode()
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            client = self.webhook.client()
            began = time.monotonic()
            try:
                status, data = client.request("POST", "/validate", self.body)
                if status != 200 or b'"allowed":false' not in data:
                    self.failures.append(f"{status} {data[:120]!r}")
                else:
                    self.latencies.append(time.monotonic() - began)
            except OSError as exc:
                self.failures.append(repr(exc))
            finally:
                client.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)

