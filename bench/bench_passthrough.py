"""Passthrough plugin figures on a simulated DGX-H100: Allocate latency, health latency.

    .venv/bin/python bench/bench_passthrough.py [--callers 100] [--calls 40] [--flips 30]

Allocate: a child process materialises dgx-h100, binds it with katamgr's apply,
and runs the real passthrough plugin (PluginManager, vm-passthrough) registered
with the kubelet simulator. 100 caller threads here call Allocate for one or
two H100s over the plugin's unix socket, each on its own channel; every call
re-reads sysfs for the devices it hands out. Two loads:
  - paced: each caller sends one call every --interval seconds, staggered
    (the way a kubelet admits pods);
  - back-to-back: each caller sends its next call as soon as the last returns
    (includes queueing behind the other 99).
Health: in one process, the time from deleting ``dev/vfio/<group>`` to the
simulated kubelet holding a ListAndWatch list with that device Unhealthy (and
from restoring it to Healthy again): inotify, rescan, gRPC stream.

Targets (DESIGN.md section 7): Allocate p99 < 2 ms with 100 concurrent callers;
a health change reaches ListAndWatch within 100 ms. Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from katamgr.apply import apply_host  # noqa: E402
from katamgr.host.pciids import PciIds, resource_name  # noqa: E402
from katamgr.host.root import HostRoot  # noqa: E402
from katamgr.host.simulate import materialise  # noqa: E402
from katamgr.plan import Naming, build_plan  # noqa: E402
from katamgr.profiles import find_profile  # noqa: E402
from sandbox_plugin.api import deviceplugin_pb2 as pb  # noqa: E402
from sandbox_plugin.api import deviceplugin_pb2_grpc as pb_grpc  # noqa: E402
from sandbox_plugin.manager import Mode, PluginManager  # noqa: E402
from sandbox_plugin.resources import HEALTHY, UNHEALTHY, socket_name_for  # noqa: E402
from sandbox_plugin.testing.kubelet import KubeletSimulator  # noqa: E402

PCI_IDS = PciIds.find()
NAMING = Naming(PCI_IDS)
H100 = resource_name(PCI_IDS, 0x10DE, 0x2330)


def simulated_dgx(root: str) -> HostRoot:
    host = materialise(find_profile("dgx-h100"), root)
    report = apply_host(host, build_plan(host, NAMING))
    if not report.ok:
        raise SystemExit(f"binding the simulated host failed: {report.failures}")
    return host


def serve_forever(root: str, ready, done, ids) -> None:
    host = simulated_dgx(root)
    with KubeletSimulator(host) as kubelet, PluginManager(host, Mode.VM_PASSTHROUGH, naming=NAMING):
        state = kubelet.wait_for(lambda s: len(s.healthy(H100)) == 8, 10)
        ids.extend(state.healthy(H100))
        ready.set()
        done.wait()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def callers_run(socket: Path, gpus: list[str], callers: int, calls: int, interval: float):
    latencies: list[float] = []
    lock = threading.Lock()
    gate = threading.Barrier(callers + 1)

    def caller(index: int) -> None:
        channel = grpc.insecure_channel(f"unix://{socket}")
        stub = pb_grpc.DevicePluginStub(channel)
        # Half the pods ask for one GPU, half for two.
        wanted = [gpus[index % 8]] if index % 2 else [gpus[index % 8], gpus[(index + 1) % 8]]
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=wanted)])
        stub.Allocate(request, timeout=10)  # connected before the clock starts
        mine = []
        gate.wait()
        if interval:
            time.sleep(random.uniform(0, interval))
        next_at = time.perf_counter()
        for _ in range(calls):
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
    gate.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return latencies, time.perf_counter() - began


def show(label: str, latencies: list[float], elapsed: float) -> None:
    ms = [x * 1000 for x in latencies]
    print(f"  {label:<36} n={len(ms):<5} p50={percentile(ms, 0.5):6.2f} ms  "
          f"p99={percentile(ms, 0.99):6.2f} ms  max={max(ms):6.2f} ms  {len(ms) / elapsed:7.0f} calls/s")


def bench_allocate(callers: int, calls: int, interval: float) -> None:
    root = tempfile.mkdtemp(prefix="kpb-")
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    ids = ctx.Manager().list()
    child = ctx.Process(target=serve_forever, args=(root, ready, done, ids), daemon=True)
    child.start()
    try:
        if not ready.wait(60):
            print("  the plugin did not come up")
            return
        gpus = list(ids)
        socket = HostRoot.at(root).path("/var/lib/kubelet/device-plugins") / socket_name_for(H100)
        print(f"Allocate of {H100} on a simulated dgx-h100 (target p99 < 2 ms, {callers} callers):")
        show("1 caller (service time)", *callers_run(socket, gpus, 1, calls * 4, 0.0))
        show(f"{callers} callers, 1 call/{interval * 1000:.0f} ms each",
             *callers_run(socket, gpus, callers, calls, interval))
        show(f"{callers} callers, back-to-back", *callers_run(socket, gpus, callers, calls, 0.0))
    finally:
        done.set()
        child.join(10)
        shutil.rmtree(root, ignore_errors=True)


def bench_health(flips: int) -> None:
    root = tempfile.mkdtemp(prefix="kpb-")
    try:
        host = simulated_dgx(root)
        with KubeletSimulator(host) as kubelet, PluginManager(host, Mode.VM_PASSTHROUGH, naming=NAMING):
            kubelet.wait_for(lambda s: len(s.healthy(H100)) == 8, 10)
            node, device = host.path("/dev/vfio/16"), "0000:13:00.0"

            def health_of(state):
                return next((d.health for d in state.devices.get(H100, []) if d.id == device), None)

            down, up = [], []
            for _ in range(flips):
                begin = time.perf_counter()
                node.unlink()
                kubelet.wait_for(lambda s: health_of(s) == UNHEALTHY, 5)
                down.append(time.perf_counter() - begin)
                begin = time.perf_counter()
                node.touch()
                kubelet.wait_for(lambda s: health_of(s) == HEALTHY, 5)
                up.append(time.perf_counter() - begin)
        print("Health change to ListAndWatch (target < 100 ms):")
        for label, values in (("dev/vfio/16 deleted -> Unhealthy", down), ("restored -> Healthy", up)):
            ms = [x * 1000 for x in values]
            print(f"  {label:<36} n={len(ms):<5} p50={percentile(ms, 0.5):6.1f} ms  "
                  f"p99={percentile(ms, 0.99):6.1f} ms  max={max(ms):6.1f} ms")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--callers", type=int, default=100)
    parser.add_argument("--calls", type=int, default=40, help="calls per caller")
    parser.add_argument("--interval", type=float, default=0.1, help="paced: seconds between a caller's calls")
    parser.add_argument("--flips", type=int, default=30, help="health changes to time")
    args = parser.parse_args()
    bench_allocate(args.callers, args.calls, args.interval)
    bench_health(args.flips)


if __name__ == "__main__":
    main()
