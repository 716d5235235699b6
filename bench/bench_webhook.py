"""Admission latency of ``katamgr webhook`` over TLS on loopback: at a steady rate, and
under thousands of slow clients.

    .venv/bin/python bench/bench_webhook.py [--rate 200] [--seconds 10] [--connections 4]
                                            [--slow-clients 3000] [--hold 12] [--baseline 3]

Runs the real ``katamgr webhook`` in its own process (a fresh CA and server certificate
in a temp dir) and, in this process, --connections keep-alive HTTPS connections (as the
API server keeps them), each sending its share of --rate AdmissionReviews per second on a
fixed schedule (open loop: a late answer does not slow the next send). Reviews alternate
/mutate and /validate over the pod cases of the tests (tests/support/podkit.py: no GPU,
init containers, a GPU pod, passthrough with and without Kata, a Deployment's pod).
Latency is from the scheduled send time to the whole answer read (so falling behind
counts). Prints p50, p90, p99, max and the achieved rate; the target is p99 under 10 ms.

Then the slow clients of the security review (--slow-clients, default 3,000; 0 skips them): TLS
connections opened from 4 threads of this process, each with its handshake done and half a
request head sent, then held for --hold seconds, against a fresh webhook with its default
limits. Meanwhile a client sends a review every 50 ms on a keep-alive connection and another
every 100 ms on a new connection each time (the handshake inside the flood), as they did for
--baseline seconds before the attack. Prints the webhook's threads and RSS (at most, sampled
every 20 ms), those reviews' p50 and p99 before the attack, while the slow clients are being
opened and while they are held, and how the slow connections ended.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "admission")]

from support import podkit  # noqa: E402
from support.tlskit import Client, make_ca, write_server_pair  # noqa: E402
from webhookproc import Attack, Sampler, WebhookProcess, raise_fd_limit  # noqa: E402


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(client: Client, deadline: float) -> None:
    while True:
        try:
            if client.request("GET", "/healthz")[0] == 200:
                return
        except OSError:
            client.close()
        if time.monotonic() > deadline:
            raise SystemExit("katamgr webhook did not come up")
        time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=200.0, help="reviews per second (default 200)")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long (default 10)")
    parser.add_argument("--connections", type=int, default=4, help="keep-alive connections (default 4)")
    parser.add_argument("--slow-clients", type=int, default=3000,
                        help="slow TLS clients held open (default 3000; 0: none)")
    parser.add_argument("--hold", type=float, default=12.0,
                        help="seconds the slow clients are held once all are open (default 12: "
                             "past the webhook's 10 s request deadline)")
    parser.add_argument("--baseline", type=float, default=3.0,
                        help="seconds of reviews before the slow clients (default 3)")
    args = parser.parse_args()
    code = steady_rate(args)
    if args.slow_clients:
        code |= slow_clients(args)
    return code


def steady_rate(args: argparse.Namespace) -> int:

    cases = list(podkit.cases().values())
    bodies = [json.dumps(podkit.review(pod)).encode() for pod in cases]
    with tempfile.TemporaryDirectory(prefix="bench-webhook-") as tmp:
        ca = make_ca()
        cert, key = Path(tmp) / "tls.crt", Path(tmp) / "tls.key"
        write_server_pair(ca, cert, key)
        port = free_port()
        server = subprocess.Popen([str(REPO / ".venv" / "bin" / "katamgr"), "webhook",
                                   "--listen", f"127.0.0.1:{port}", "--tls-cert-file", str(cert),
                                   "--tls-private-key-file", str(key)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_healthy(Client(port, ca), time.monotonic() + 20)
            latencies: list[float] = []
            errors: list[str] = []
            lock = threading.Lock()
            per_conn = args.rate / args.connections
            total = int(args.rate * args.seconds)
            start = time.monotonic() + 0.5

            def caller(n: int) -> None:
                client = Client(port, ca)
                client.request("GET", "/healthz")  # handshake outside the timed part
                mine: list[float] = []
                i = 0
                while True:
                    due = start + (i + n / args.connections) / per_conn
                    k = i * args.connections + n
                    if k >= total:
                        break
                    pause = due - time.monotonic()
                    if pause > 0:
                        time.sleep(pause)
                    path = "/mutate" if k % 2 else "/validate"
                    try:
                        status, data = client.request("POST", path, bodies[k % len(bodies)])
                        if status != 200 or b'"response"' not in data:
                            errors.append(f"{status} {data[:80]!r}")
                    except OSError as exc:
                        errors.append(str(exc))
                    mine.append(time.monotonic() - due)
                    i += 1
                client.close()
                with lock:
                    latencies.extend(mine)

            threads = [threading.Thread(target=caller, args=(n,)) for n in range(args.connections)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.monotonic() - start
        finally:
            server.terminate()
            server.wait(10)

    ms = sorted(x * 1000 for x in latencies)
    q = statistics.quantiles(ms, n=100)
    print(f"katamgr webhook, TLS on loopback, {len(ms)} reviews in {elapsed:.1f} s "
          f"({len(ms) / elapsed:.0f}/s asked {args.rate:.0f}/s) over {args.connections} connections, "
          f"{len(errors)} errors")
    print(f"latency ms: p50 {q[49]:.2f}  p90 {q[89]:.2f}  p99 {q[98]:.2f}  max {ms[-1]:.2f}  "
          f"(target p99 < 10: {'met' if q[98] < 10 else 'NOT met'})")
    for e in errors[:5]:
        print("error:", e)
    return 0 if not errors else 1


class Timed:
    """Reviews every ``period`` s, on one keep-alive connection or a new one each time."""

    def __init__(self, webhook: WebhookProcess, period: float, keep_alive: bool) -> None:
        self.webhook, self.period, self.keep_alive = webhook, period, keep_alive
        self.body = json.dumps(podkit.review(podkit.cases()["passthrough-kata"])).encode()
        self.runs: list[list[float]] = [[]]
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        client = self.webhook.client()
        while not self._stop.wait(self.period):
            began = time.monotonic()
            try:
                status, data = client.request("POST", "/validate", self.body)
                if status != 200 or b'"allowed":true' not in data:
                    self.errors.append(f"{status} {data[:80]!r}")
                else:
                    self.runs[-1].append(time.monotonic() - began)
            except OSError as exc:
                self.errors.append(repr(exc))
            if not self.keep_alive:
                client.close()
        client.close()

    def next_run(self) -> None:
        self.runs.append([])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)


def figures(latencies: list[float]) -> str:
    if len(latencies) < 2:
        return f"{len(latencies)} answered"
    ms = statistics.quantiles([x * 1000 for x in latencies], n=100, method="inclusive")
    return f"p50 {ms[49]:.1f} ms  p99 {ms[98]:.1f} ms  max {max(latencies) * 1000:.1f} ms  ({len(latencies)} answered)"


def slow_clients(args: argparse.Namespace) -> int:
    raise_fd_limit()
    with tempfile.TemporaryDirectory(prefix="bench-webhook-slow-") as tmp:
        webhook = WebhookProcess.launch(Path(tmp))
        try:
            threads_before, rss_before = webhook.threads(), webhook.rss_mib()
            timed = [Timed(webhook, 0.05, keep_alive=True), Timed(webhook, 0.1, keep_alive=False)]
            time.sleep(args.baseline)
            for t in timed:
                t.next_run()
            sampler = Sampler(webhook)
            attack = Attack(webhook.port, webhook.ca.client_context(), args.slow_clients).run()
            for t in timed:
                t.next_run()
            time.sleep(args.hold)
            outcome = attack.outcome(wait=0.1)
            for t in timed:
                t.stop()
            sampler.stop()
            attack.close()
            healthy = webhook.client().request("GET", "/healthz")[0] == 200
        finally:
            webhook.stop()
    errors = [e for t in timed for e in t.errors]
    print(f"\nslow clients: {args.slow_clients} TLS connections (handshake done, half a head sent) "
          f"opened in {attack.seconds:.1f} s from {attack.threads} threads, then held {args.hold:g} s, "
          f"against katamgr webhook with its default limits")
    print(f"webhook: threads {sampler.max_threads} at most ({threads_before} before); RSS "
          f"{rss_before:.1f} MiB before, {sampler.max_rss:.1f} MiB at most (+{sampler.max_rss - rss_before:.1f})")
    print(f"the slow connections at the end: {outcome['open']} still open, {outcome['closed']} "
          f"closed to make room for newer ones, {outcome['408']} cut off at the request deadline "
          f"(408); {attack.refused} refused before their handshake ended")
    for t, name in zip(timed, ("keep-alive connection, every 50 ms", "new connection each, every 100 ms"), strict=True):
        print(f"reviews on a {name}:")
        for run, when in zip(t.runs, ("before", "while opening", "while held"), strict=True):
            print(f"  {when:14} {figures(run)}")
    print(f"{len(errors)} review errors; /healthz after: {'ok' if healthy else 'FAILED'}")
    for e in errors[:5]:
        print("error:", e)
    return 0 if not errors and healthy else 1


if __name__ == "__main__":
    sys.exit(main())
