"""Pod creates per second through 1 and 3 ``katamgr webhook`` replicas: the chart's isolation
webhook, fail-closed on every pod create, at the rates a fleet's API server sends.

    .venv/bin/python bench/bench_webhook_fleet.py [--replicas 1 3] [--rates 200 500 1000]
                                                  [--seconds 10] [--connections 8] [--senders 4]

Each replica is the real ``katamgr webhook`` in its own process (its command line only; a
fresh CA and certificate in a temp dir), as the chart's Deployment runs it. A pod create is
what the API server does for it with the chart's two configurations: one AdmissionReview to
/mutate, then one to /validate (MutatingWebhookConfiguration, then ValidatingWebhookConfiguration,
in that order), over keep-alive TLS connections, --connections per replica spread over the
replicas as the Service's endpoints spread the API server's connections. --senders processes
send them on a fixed schedule (open loop: a late answer does not delay the next create), the pods
of the tests' cases in turn (tests/support/podkit.py). Latency is a create's, from its scheduled
time to both answers read, so falling behind counts. Prints, per replicas and rate: creates per
second achieved, p50, p99, max, errors (any answer but 200 with a response, or a connection
error), and each replica's CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "admission")]

from support import podkit  # noqa: E402
from support.tlskit import Client  # noqa: E402
from webhookproc import WebhookProcess, raise_fd_limit  # noqa: E402


def sender(targets: list, rate: float, seconds: float, index: int, senders: int, connections: int,
           start: float, out) -> None:
    """One process's share: ``connections`` threads, each a keep-alive connection to one replica."""
    import threading

    bodies = [json.dumps(podkit.review(pod)).encode() for pod in podkit.cases().values()]
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    total = int(rate * seconds)
    lanes = senders * connections  # every connection of every sender, one schedule each
    per_lane = rate / lanes

    def lane(n: int) -> None:
        lane_id = index * connections + n
        client = Client(*targets[lane_id % len(targets)])
        try:
            client.request("GET", "/healthz")  # the handshake outside the timed part
        except OSError as exc:
            errors.append(f"connect: {exc}")
            return
        mine: list[float] = []
        i = 0
        while True:
            k = i * lanes + lane_id
            if k >= total:
                break
            due = start + (i + lane_id / lanes) / per_lane
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            body = bodies[k % len(bodies)]
            try:
                for path in ("/mutate", "/validate"):
                    status, data = client.request("POST", path, body)
                    if status != 200 or b'"response"' not in data:
                        errors.append(f"{path} {status} {data[:80]!r}")
                        break
            except OSError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                client.close()
                client = Client(*targets[lane_id % len(targets)])
            mine.append(time.monotonic() - due)
            i += 1
        client.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=lane, args=(n,)) for n in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put((latencies, errors))


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    import os

    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(replicas: int, rate: float, args: argparse.Namespace, tmp: Path) -> dict:
    hooks = []
    for i in range(replicas):
        (tmp / f"r{i}-{rate:g}").mkdir()
        hooks.append(WebhookProcess.launch(tmp / f"r{i}-{rate:g}"))
    try:
        targets = [(h.port, h.ca) for h in hooks]  # each replica with a CA of its own
        cpu_before = [cpu_seconds(h.process.pid) for h in hooks]
        queue = multiprocessing.get_context("fork").Queue()
        connections = max(1, args.connections * replicas // args.senders)
        start = time.monotonic() + 1.0
        procs = [multiprocessing.get_context("fork").Process(
            target=sender, args=(targets, rate, args.seconds, i, args.senders, connections, start, queue))
            for i in range(args.senders)]
        for p in procs:
            p.start()
        latencies: list[float] = []
        errors: list[str] = []
        for _ in procs:
            got_latencies, got_errors = queue.get(timeout=args.seconds * 10 + 60)
            latencies += got_latencies
            errors += got_errors
        for p in procs:
            p.join()
        elapsed = time.monotonic() - start
        cpu = [cpu_seconds(h.process.pid) - b for h, b in zip(hooks, cpu_before, strict=True)]
    finally:
        for h in hooks:
            h.stop()
    ms = sorted(x * 1000 for x in latencies)
    q = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else [float("nan")] * 99
    return {"replicas": replicas, "rate": rate, "done": len(ms), "per_second": len(ms) / elapsed,
            "p50": q[49], "p99": q[98], "max": ms[-1] if ms else float("nan"), "errors": errors,
            "cpu": cpu, "elapsed": elapsed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--rates", type=float, nargs="+", default=[200.0, 500.0, 1000.0],
                        help="pod creates per second (each two reviews)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=8, help="keep-alive connections per replica")
    parser.add_argument("--senders", type=int, default=4, help="sending processes")
    args = parser.parse_args()
    raise_fd_limit()
    code = 0
    with tempfile.TemporaryDirectory(prefix="bench-webhook-fleet-") as name:
        tmp = Path(name)
        for replicas in args.replicas:
            for rate in args.rates:
                (tmp / f"{replicas}").mkdir(exist_ok=True)
                r = run(replicas, rate, args, tmp / f"{replicas}")
                cpu = ", ".join(f"{c:.1f}" for c in r["cpu"])
                print(f"{replicas} replica(s), {rate:.0f} creates/s asked: {r['per_second']:.0f}/s done "
                      f"({r['done']} in {r['elapsed']:.1f} s); create latency p50 {r['p50']:.1f} ms, "
                      f"p99 {r['p99']:.1f} ms, max {r['max']:.0f} ms; {len(r['errors'])} errors; "
                      f"webhook CPU s: {cpu}", flush=True)
                for e in r["errors"][:3]:
                    print("  error:", e)
                code |= bool(r["errors"])
    return 1 if code else 0


if __name__ == "__main__":
    sys.exit(main())
