"""Admission latency of ``katamgr webhook`` over TLS on loopback at a steady rate.

    .venv/bin/python bench/bench_webhook.py [--rate 200] [--seconds 10] [--connections 4]

Runs the real ``katamgr webhook`` in its own process (a fresh CA and server certificate
in a temp dir) and, in this process, --connections keep-alive HTTPS connections (as the
API server keeps them), each sending its share of --rate AdmissionReviews per second on a
fixed schedule (open loop: a late answer does not slow the next send). Reviews alternate
/mutate and /validate over the pod cases of the tests (tests/support/podkit.py: no GPU,
init containers, a GPU pod, passthrough with and without Kata, a Deployment's pod).
Latency is from the scheduled send time to the whole answer read (so falling behind
counts). Prints p50, p90, p99, max and the achieved rate; the target is p99 under 10 ms.
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
sys.path.insert(0, str(REPO / "tests"))

from support import podkit  # noqa: E402
from support.tlskit import Client, make_ca, write_server_pair  # noqa: E402


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
    args = parser.parse_args()

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


if __name__ == "__main__":
    sys.exit(main())
