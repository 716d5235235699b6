"""Device plugin server figures: Allocate latency and health-change propagation.

    .venv/bin/python bench/bench_plugin.py [--callers 100] [--calls 50]

Allocate: a PluginServer (StaticResource, registered with the kubelet
simulator) runs in a child process, as the plugin does on a node; 100 caller
threads in this process call Allocate over the unix socket, each on its own
channel. Two loads are measured:
  - saturated: every caller sends its next call as soon as the last returns,
    so the figure includes queueing behind the other 99;
  - paced: every caller sends one call every --interval seconds (staggered),
    100 callers concurrently, which is closer to a kubelet admitting pods.
Health change: time from StaticResource.set_health() to the simulated kubelet
holding the new ListAndWatch list, in one process.

Targets (DESIGN.md section 7): Allocate p99 < 2 ms with 100 concurrent callers;
a health change reaches ListAndWatch within 100 ms. Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from katamgr.host.root import HostRoot  # noqa: E402
from sandbox_plugin.api import deviceplugin_pb2 as pb  # noqa: E402
from sandbox_plugin.api import deviceplugin_pb2_grpc as pb_grpc  # noqa: E402
from sandbox_plugin.resources import (  # noqa: E402
    HEALTHY,
    UNHEALTHY,
    PluginDevice,
    StaticResource,
)
from sandbox_plugin.server import PluginServer  # noqa: E402
from sandbox_plugin.testing.kubelet import KubeletSimulator  # noqa: E402

NAME = "example.com/gpu"
DEVICE_IDS = [f"gpu-{i}" for i in range(8)]


def resource() -> StaticResource:
    return StaticResource(
        NAME,
        [PluginDevice(d, numa_node=n // 4) for n, d in enumerate(DEVICE_IDS)],
        cdi_kind="example.com/gpu",
    )


def serve_forever(root: str, ready, done) -> None:
    host = HostRoot.at(root)
    with (
        KubeletSimulator(host) as kubelet,
        PluginServer(resource(), host, max_workers=32) as server,
    ):
        server.wait_registered(10)
        kubelet.wait_for(lambda s: NAME in s.devices, 10)
        ready.set()
        done.wait()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_callers(
    socket: Path, callers: int, calls: int, interval: float
) -> tuple[list[float], float]:
    latencies: list[float] = []
    lock = threading.Lock()
    start_gate = threading.Barrier(callers + 1)

    def caller(index: int) -> None:
        channel = grpc.insecure_channel(f"unix://{socket}")
        stub = pb_grpc.DevicePluginStub(channel)
        ids = [DEVICE_IDS[index % len(DEVICE_IDS)]]
        request = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]
        )
        stub.Allocate(request, timeout=10)  # connect before the clock starts
        mine = []
        start_gate.wait()
        if interval:
            time.sleep(random.uniform(0, interval))
        next_at = time.perf_counter()
        for _ in range(calls):
            if interval:
                next_at += interval
            begin = time.perf_counter()
            stub.Allocate(request, timeout=10)
            mine.append(time.perf_counter() - begin)
            if interval:
                time.sleep(max(0.0, next_at - time.perf_counter()))
        channel.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
    for thread in threads:
        thread.start()
    start_gate.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return latencies, time.perf_counter() - began


def report_allocate(label: str, latencies: list[float], elapsed: float) -> None:
    ms = [x * 1000 for x in latencies]
    print(
        f"  {label:<34} n={len(ms):<6} p50={percentile(ms, 0.50):7.2f} ms  "
        f"p99={percentile(ms, 0.99):7.2f} ms  max={max(ms):7.2f} ms  "
        f"{len(ms) / elapsed:8.0f} calls/s"
    )


def bench_allocate(callers: int, calls: int, interval: float) -> None:
    root = tempfile.mkdtemp(prefix="kpb-")
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=serve_forever, args=(root, ready, done), daemon=True)
    child.start()
    try:
        if not ready.wait(30):
            print("  the plugin server did not come up")
            return
        socket = HostRoot.at(root).path("/var/lib/kubelet/device-plugins") / "example.com-gpu.sock"
        print(f"Allocate over {socket.name}, {callers} concurrent callers (target p99 < 2 ms):")
        lat, elapsed = run_callers(socket, 1, calls * 4, 0.0)
        report_allocate("1 caller (service time)", lat, elapsed)
        lat, elapsed = run_callers(socket, callers, calls, interval)
        report_allocate(f"{callers} callers, 1 call/{interval * 1000:.0f} ms each", lat, elapsed)
        lat, elapsed = run_callers(socket, callers, calls, 0.0)
        report_allocate(f"{callers} callers, saturated", lat, elapsed)
    finally:
        done.set()
        child.join(10)
        shutil.rmtree(root, ignore_errors=True)


def bench_health(rounds: int) -> None:
    root = tempfile.mkdtemp(prefix="kpb-")
    host = HostRoot.at(root)
    res = resource()
    delays = []
    try:
        with KubeletSimulator(host) as kubelet, PluginServer(res, host):
            kubelet.wait_for(lambda s: NAME in s.devices, 10)
            for n in range(rounds):
                health = UNHEALTHY if n % 2 == 0 else HEALTHY
                begin = time.perf_counter()
                res.set_health("gpu-3", health)
                kubelet.wait_for(
                    lambda s, h=health: any(
                        d.id == "gpu-3" and d.health == h for d in s.devices[NAME]
                    ),
                    5,
                )
                delays.append((time.perf_counter() - begin) * 1000)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("Health change -> ListAndWatch update at the kubelet (target < 100 ms):")
    print(
        f"  n={len(delays)}  p50={statistics.median(delays):.2f} ms  "
        f"p99={percentile(delays, 0.99):.2f} ms  max={max(delays):.2f} ms"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description="device plugin server benchmark")
    parser.add_argument("--callers", type=int, default=100)
    parser.add_argument("--calls", type=int, default=50, help="Allocate calls per caller")
    parser.add_argument("--interval", type=float, default=0.1, help="paced: seconds between calls")
    parser.add_argument("--health-rounds", type=int, default=200)
    args = parser.parse_args()
    bench_allocate(args.callers, args.calls, args.interval)
    bench_health(args.health_rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
