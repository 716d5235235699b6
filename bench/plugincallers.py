"""The Allocate callers of bench_plugin.py (and bench_memory.py's plugin load), playing
pods' kubelets against a device plugin's socket through grpcio's Python client, bytes in
and out (no protobuf work in the caller), each call timed around it in the caller:

- serial: calls back to back on one channel, with the plugin process's CPU time over them;
- paced: many callers at a fixed rate each, spread over child processes (``spawn``), each
  caller a thread with its own channel and connection, all connected before any clock starts.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ALLOCATE = "/v1beta1.DevicePlugin/Allocate"


def allocate_request(ids: list[str]) -> bytes:
    from kubeletapi import deviceplugin_pb2 as pb

    return pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]
    ).SerializeToString()


def cpu_seconds(pid: int) -> float:
    """User+system CPU time of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Load:
    callers: int
    rate: float  # calls per second per caller
    seconds: float
    # Half the callers ask for two GPUs, any two: a plugin with Fabric Manager in the Shared
    # NVSwitch model refuses two that are not one partition, so a load on it asks for one.
    pairs: bool = True


def caller_process(socket: str, gpus: list[str], indexes: list[int], load: Load, gate, out) -> None:
    """Run the callers ``indexes`` as threads, each on its own grpcio channel (and connection);
    put their latencies on ``out``."""
    from nodesim.dial import dial

    latencies: list[float] = []
    failures = []
    lock = threading.Lock()
    connected = threading.Barrier(len(indexes) + 1)

    def caller(index: int) -> None:
        # Half the pods ask for one GPU, half for two.
        wanted = [gpus[index % len(gpus)]]
        if load.pairs and index % 2 == 0:
            wanted.append(gpus[(index + 1) % len(gpus)])
        request = allocate_request(wanted)
        mine = []
        try:
            with dial(socket) as channel:  # a connection of its own, as each kubelet dial is
                call = channel.unary_unary(ALLOCATE)  # bytes in, bytes out: no (de)serializing
                call(request, timeout=10)  # connected before the clock starts
                connected.wait()
                interval = 1.0 / load.rate
                time.sleep(random.uniform(0, interval))
                next_at = time.monotonic()
                end = next_at + load.seconds
                while next_at < end:
                    next_at += interval
                    begin = time.perf_counter()
                    call(request, timeout=10)
                    mine.append(time.perf_counter() - begin)
                    time.sleep(max(0.0, next_at - time.monotonic()))
        except Exception as exc:  # a refused or failed call: the whole run is void
            failures.append(exc)
            if connected.n_waiting:
                connected.abort()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in indexes]
    for thread in threads:
        thread.start()
    try:
        connected.wait()  # every caller of this process is connected
        gate.wait()  # ... and of every other process
    except threading.BrokenBarrierError:
        gate.abort()
    for thread in threads:
        thread.join()
    out.put(None if failures else latencies)


def paced(ctx, socket: Path, gpus: list[str], load: Load, procs: int) -> list[float]:
    procs = max(1, min(procs, load.callers))
    gate = ctx.Barrier(procs)
    out = ctx.Queue()
    children = [
        ctx.Process(target=caller_process,
                    args=(str(socket), gpus, list(range(n, load.callers, procs)), load, gate, out))
        for n in range(procs)
    ]
    for child in children:
        child.start()
    results = [out.get(timeout=120 + load.seconds) for _ in children]
    for child in children:
        child.join(10)
    if any(r is None for r in results):
        raise SystemExit("a paced caller could not connect, or a call failed")
    return [x for r in results for x in r]


def serial(socket: Path, request: bytes, calls: int, pid: int) -> tuple[list[float], float]:
    """``calls`` Allocates back to back through grpcio's client, each timed around the call;
    and the plugin's CPU seconds over them."""
    import grpc

    with grpc.insecure_channel(f"unix://{socket}") as channel:
        call = channel.unary_unary(ALLOCATE)  # bytes in, bytes out: no (de)serializing
        for _ in range(200):
            call(request, timeout=10)
        out = []
        cpu_before = cpu_seconds(pid)
        for _ in range(calls):
            begin = time.perf_counter()
            call(request, timeout=10)
            out.append(time.perf_counter() - begin)
        cpu = cpu_seconds(pid) - cpu_before
    return out, cpu
