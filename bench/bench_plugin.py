"""Device plugin figures on a simulated DGX-H100, against the targets of issues 21 and 27.

    .venv/bin/python bench/bench_plugin.py [--rounds 5] [--baseline DIR] [--serial 2000]
        [--callers 100] [--rate 10] [--seconds 4] [--client-procs 4] [--flips 20]

The plugin runs as a kubelet meets it: its own process (``sandbox-device-plugin
--workload vm-passthrough``, started fresh each round), talking over its unix
sockets. This process materialises dgx-h100, binds it with katamgr's apply,
writes the CDI specs (as katamgr does with cdi enabled, so every answer carries
CDI names) and plays the kubelet as cheaply as it can: a Registration server on
kubelet.sock, then one ListAndWatch stream per round, as a kubelet opens.

Each round measures, in this order:
  - launch to first Register: from just before the process is started to the
    simulated kubelet receiving the plugin's first Register, the median of
    --launches starts (the last one goes on to the measurements below). The plugin's
    Python is compiled to bytecode beforehand (PYTHONPYCACHEPREFIX, a temp dir,
    so nothing is written into the checkout), as an installed plugin's is:
    with PYTHONDONTWRITEBYTECODE set, as in some shells, every start would
    compile every module again;
  - Allocate of 1 H100, serial: --serial calls back to back through grpcio's
    Python client (one channel, bytes in and out: no protobuf work in the caller),
    timed around each call, as NVIDIA's plugin was timed for its column: the
    client's own cost (about 0.15 ms a call) is in every figure, for both;
  - plugin CPU per Allocate: the plugin process's utime+stime
    (/proc/<pid>/stat) over the serial calls, divided by their number;
  - Allocate with --callers callers at --rate calls/s each (1 or 2 H100s per
    call, each caller starting at a random point of its period), --seconds long:
    callers spread over --client-procs processes, each a thread with its own grpcio
    channel and connection, each call timed around it in the caller;
  - memory and threads of the plugin after those loads (/proc/<pid>/status
    VmRSS, Threads);
  - health: ``dev/vfio/16`` deleted, timed until the ListAndWatch stream (grpcio,
    read in a thread of its own that timestamps each message as it arrives) carries
    0000:13:00.0 Unhealthy; then restored, until Healthy.

With --baseline DIR (another checkout of this repository, e.g. made with
``git archive HEAD | tar -x -C DIR``) the plugin from DIR runs too, round for
round, interleaved with this one, so both see the same machine load. Figures
are medians over the rounds. Prints every figure next to its target; asserts
nothing.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from support.registry_server import free_port  # noqa: E402

from gpunode.host.pciids import PciIds  # noqa: E402
from gpunode.host.root import HostRoot  # noqa: E402
from gpunode.policy.naming import resource_name  # noqa: E402
from sandbox_plugin.resources import HEALTHY, UNHEALTHY  # noqa: E402

PROFILE = "dgx-h100"
HEALTH_NODE, HEALTH_DEVICE = "/dev/vfio/16", "0000:13:00.0"
ALLOCATE = "/v1beta1.DevicePlugin/Allocate"
LIST_AND_WATCH = "/v1beta1.DevicePlugin/ListAndWatch"
REGISTER = "/v1beta1.Registration/Register"

# (figure, target, NVIDIA's sandbox-device-plugin on the same node): the targets are issue
# 27's (on h2), the launch issue 21's; NVIDIA's figures are issue 21's, its serial p50 issue
# 27's (through grpcio's client, as here).
TARGETS = {
    "launch to first Register (ms)": (208.0, 208.0),
    "Allocate serial p50 (ms)": (None, 0.204),
    "Allocate serial p99 (ms)": (0.6, 0.57),
    "plugin CPU per Allocate (us)": (250.0, 145.0),
    "Allocate paced p50 (ms)": (None, 0.48),
    "Allocate paced p99 (ms)": (1.5, 1.12),
    "RSS after the loads (MiB)": (40.0, 36.0),
    "threads after the loads": (None, 7.0),
    "node removed -> Unhealthy p50 (ms)": (1.0, 0.93),
    "node removed -> Unhealthy max (ms)": (None, None),
    "node restored -> Healthy p50 (ms)": (None, None),
}


def h100_name() -> str:
    return resource_name(PciIds.find(), 0x10DE, 0x2330)


def naming():
    from gpunode.policy.naming import Naming

    return Naming(PciIds.find())


def simulated_dgx(root: str) -> HostRoot:
    """dgx-h100 bound to vfio-pci, with the CDI specs katamgr writes (cdi enabled)."""
    from gpunode.policy.inventory import discover
    from katamgr.pipeline.cdi_specs import write_specs
    from katamgr.pipeline.devices import apply_host
    from katamgr.pipeline.plan import build_plan
    from nodesim.materialise import materialise
    from nodesim.profiles import find_profile

    host = materialise(find_profile(PROFILE), root)
    report = apply_host(host, build_plan(host, naming()))
    if not report.ok:
        raise SystemExit(f"binding the simulated host failed: {report.failures}")
    if not write_specs(host, discover(host), naming()).ok:
        raise SystemExit("writing the CDI specs failed")
    return host


def allocate_request(ids: list[str]) -> bytes:
    from kubeletapi import deviceplugin_pb2 as pb

    return pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]
    ).SerializeToString()


def proc_status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def cpu_seconds(pid: int) -> float:
    """User+system CPU time of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the paced callers (child processes) ----------------------------------------------


@dataclass(frozen=True)
class Load:
    callers: int
    rate: float  # calls per second per caller
    seconds: float


def caller_process(socket: str, gpus: list[str], indexes: list[int], load: Load, gate, out) -> None:
    """Run the callers ``indexes`` as threads, each on its own grpcio channel (and connection);
    put their latencies on ``out``."""
    import grpc

    latencies: list[float] = []
    failures = []
    lock = threading.Lock()
    connected = threading.Barrier(len(indexes) + 1)

    def caller(index: int) -> None:
        # Half the pods ask for one GPU, half for two.
        wanted = [gpus[index % len(gpus)]]
        if index % 2 == 0:
            wanted.append(gpus[(index + 1) % len(gpus)])
        request = allocate_request(wanted)
        mine = []
        try:
            with grpc.insecure_channel(f"unix://{socket}",
                                       options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
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


# -- the kubelet's side: Registration, and ListAndWatch timestamped --------------------


class Kubelet:
    """Serves Registration on kubelet.sock and records when each Register came."""

    def __init__(self, host: HostRoot) -> None:
        from grpcwire.server import GrpcServer
        from kubeletapi.deviceplugin_paths import DEVICE_PLUGIN_DIR

        directory = host.path(DEVICE_PLUGIN_DIR)
        directory.mkdir(parents=True, exist_ok=True)
        self._cond = threading.Condition()
        self.registrations: list[tuple[float, str]] = []  # (monotonic, resource name)
        self._server = GrpcServer(str(directory / "kubelet.sock"), {REGISTER: self._register}, name="kubelet")
        self._server.start()

    def _register(self, request: bytes) -> bytes:
        from kubeletapi import deviceplugin_pb2 as pb

        arrived = time.monotonic()
        name = pb.RegisterRequest.FromString(request).resource_name
        with self._cond:
            self.registrations.append((arrived, name))
            self._cond.notify_all()
        return b""  # Empty

    def first_register(self, name: str, after: float, timeout: float = 60.0) -> float:
        """When the first Register since ``after`` came, once ``name`` has registered too."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not any(t >= after and n == name for t, n in self.registrations):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{name} did not register")
                self._cond.wait(left)
            return min(t for t, _ in self.registrations if t >= after)

    def stop(self) -> None:
        self._server.stop()


class HealthWatch:
    """A ListAndWatch stream (grpcio) read in a thread, each message timestamped as it arrives."""

    def __init__(self, socket: Path) -> None:
        import grpc

        self._channel = grpc.insecure_channel(f"unix://{socket}")
        self._cond = threading.Condition()
        self.seen: list[tuple[float, str | None]] = []  # (perf_counter, health of HEALTH_DEVICE)
        self.healthy: list[str] = []  # in the latest list
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from kubeletapi import deviceplugin_pb2 as pb

        try:
            for message in self._channel.unary_stream(LIST_AND_WATCH)(pb.Empty().SerializeToString()):
                arrived = time.perf_counter()
                devices = pb.ListAndWatchResponse.FromString(message).devices
                health = next((d.health for d in devices if d.ID == HEALTH_DEVICE), None)
                with self._cond:
                    self.seen.append((arrived, health))
                    self.healthy = [d.ID for d in devices if d.health == HEALTHY]
                    self._cond.notify_all()
        except Exception:  # the plugin stopped: the stream is over
            pass

    def wait_healthy(self, count: int, timeout: float = 30.0) -> list[str]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.healthy) != count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"never {count} healthy devices: {self.healthy}")
                self._cond.wait(left)
            return list(self.healthy)

    def wait(self, health: str, after: float, timeout: float = 5.0) -> float:
        """When the stream first said ``health`` after ``after``; TimeoutError if it did not."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                hit = next((t for t, h in self.seen if t >= after and h == health), None)
                if hit is not None:
                    return hit
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{HEALTH_DEVICE} never turned {health}")
                self._cond.wait(left)

    def close(self) -> None:
        self._channel.close()


# -- one round -------------------------------------------------------------------------


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


def plugin_env(source: Path, pycache: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(source), PYTHONPYCACHEPREFIX=str(pycache))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def compile_plugin(source: Path, pycache: Path) -> None:
    """Have every module a plugin start imports compiled under ``pycache``."""
    subprocess.run([sys.executable, "-c", "import sandbox_plugin.cli, sandbox_plugin.manager, "
                    "sandbox_plugin.passthrough, sandbox_plugin.server, cdi.cache, kubeletapi.deviceplugin_pb2"],
                   cwd=source, env=plugin_env(source, pycache), check=True)


def one_round(ctx, host: HostRoot, kubelet: Kubelet, source: Path, args, log: Path,
              pycache: Path) -> dict[str, float]:
    from kubeletapi.deviceplugin_paths import DEVICE_PLUGIN_DIR
    from sandbox_plugin.resources import socket_name_for

    name = h100_name()
    socket = host.path(DEVICE_PLUGIN_DIR) / socket_name_for(name)
    figures: dict[str, float] = {}
    env = plugin_env(source, pycache)

    def launch() -> tuple[subprocess.Popen, float]:
        with open(log, "ab") as output:
            launched = time.monotonic()
            plugin = subprocess.Popen(
                # As the chart runs it: metrics on (prometheus_client and the HTTP server are
                # part of its start-up and memory).
                [sys.executable, "-m", "sandbox_plugin.cli", "--workload", "vm-passthrough",
                 "--host-root", str(host.root), "--metrics-address", f"127.0.0.1:{free_port()}"],
                cwd=source, env=env, stdout=output, stderr=subprocess.STDOUT,
            )
        try:
            return plugin, (kubelet.first_register(name, launched) - launched) * 1000
        except BaseException:
            stop(plugin)
            raise

    # A start is one sample of whatever else the machine does at that moment: take several.
    starts = []
    for _ in range(args.launches - 1):
        plugin, took = launch()
        starts.append(took)
        stop(plugin)
    plugin, took = launch()
    starts.append(took)
    figures["launch to first Register (ms)"] = statistics.median(starts)
    watch = None
    try:
        watch = HealthWatch(socket)
        gpus = watch.wait_healthy(8)
        time.sleep(0.3)  # the plugin's start-up work (the first rescan) is over

        latencies, cpu = serial(socket, allocate_request([HEALTH_DEVICE]), args.serial, plugin.pid)
        figures["Allocate serial p50 (ms)"] = percentile(latencies, 0.5) * 1000
        figures["Allocate serial p99 (ms)"] = percentile(latencies, 0.99) * 1000
        figures["plugin CPU per Allocate (us)"] = cpu / args.serial * 1e6

        latencies = paced(ctx, socket, gpus, Load(args.callers, args.rate, args.seconds), args.client_procs)
        figures["Allocate paced p50 (ms)"] = percentile(latencies, 0.5) * 1000
        figures["Allocate paced p99 (ms)"] = percentile(latencies, 0.99) * 1000

        status = proc_status(plugin.pid)
        figures["RSS after the loads (MiB)"] = int(status["VmRSS"].split()[0]) / 1024
        figures["threads after the loads"] = int(status["Threads"])

        node = host.path(HEALTH_NODE)
        down, up = [], []
        for _ in range(args.flips):
            time.sleep(0.06)  # past the watcher's settling of the last change
            began = time.perf_counter()
            node.unlink()
            down.append((watch.wait(UNHEALTHY, began) - began) * 1000)
            time.sleep(0.06)
            began = time.perf_counter()
            node.touch()
            up.append((watch.wait(HEALTHY, began) - began) * 1000)
        figures["node removed -> Unhealthy p50 (ms)"] = percentile(down, 0.5)
        figures["node removed -> Unhealthy max (ms)"] = max(down)
        figures["node restored -> Healthy p50 (ms)"] = percentile(up, 0.5)
    finally:
        if watch is not None:
            watch.close()
        stop(plugin)
        if not host.path(HEALTH_NODE).exists():
            host.path(HEALTH_NODE).touch()
    return figures


def stop(plugin: subprocess.Popen) -> None:
    plugin.send_signal(signal.SIGTERM)
    try:
        plugin.wait(10)
    except subprocess.TimeoutExpired:
        plugin.kill()
        plugin.wait()


def report(results: dict[str, list[dict[str, float]]], rounds: int) -> None:
    labels = list(results)
    print(f"\nMedians of {rounds} round(s); NVIDIA's figures from issues 21 and 27 (same simulated node).")
    head = f"  {'figure':<42}" + "".join(f"{label:>12}" for label in labels) + f"{'target':>10}{'NVIDIA':>9}"
    print(head + "  verdict (" + labels[-1] + ")")
    for figure, (target, nvidia) in TARGETS.items():
        values = [statistics.median(r[figure] for r in results[label]) for label in labels]
        line = f"  {figure:<42}" + "".join(f"{v:12.2f}" for v in values)
        line += f"{target:10.2f}" if target is not None else f"{'-':>10}"
        line += f"{nvidia:9.2f}" if nvidia is not None else f"{'-':>9}"
        if target is not None:
            line += "  met" if values[-1] <= target else "  MISSED"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", type=Path, help="another checkout whose plugin runs too, interleaved")
    parser.add_argument("--launches", type=int, default=3, help="plugin starts timed per round (median)")
    parser.add_argument("--serial", type=int, default=2000, help="serial Allocate calls per round")
    parser.add_argument("--callers", type=int, default=100)
    parser.add_argument("--rate", type=float, default=10.0, help="calls per second per paced caller")
    parser.add_argument("--seconds", type=float, default=4.0, help="how long the paced load runs")
    parser.add_argument("--client-procs", type=int, default=4, help="processes for the paced callers")
    parser.add_argument("--flips", type=int, default=20, help="health changes to time per round")
    args = parser.parse_args()

    sources = {"this": REPO}
    if args.baseline is not None:
        sources = {"baseline": args.baseline.resolve(), "this": REPO}
    ctx = multiprocessing.get_context("spawn")
    root = tempfile.mkdtemp(prefix="kpb-")
    scratch = Path(tempfile.mkdtemp(prefix="kpb-log-"))
    log, pycache = scratch / "plugin.log", scratch / "pycache"
    results: dict[str, list[dict[str, float]]] = {label: [] for label in sources}
    print(f"{PROFILE}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the start; "
          f"plugin log: {log}")
    kubelet = None
    try:
        host = simulated_dgx(root)
        kubelet = Kubelet(host)
        for source in sources.values():
            compile_plugin(source, pycache)
        for round_ in range(args.rounds):
            order = list(sources.items())
            if round_ % 2:
                order.reverse()  # neither goes first every time
            for label, source in order:
                load = os.getloadavg()[0]
                figures = one_round(ctx, host, kubelet, source, args, log, pycache)
                results[label].append(figures)
                print(f"round {round_ + 1} {label} (load average {load:.2f}): " + ", ".join(
                    f"{k.split(' (')[0]} {v:.2f}" for k, v in figures.items()), flush=True)
    finally:
        if kubelet is not None:
            kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(pycache, ignore_errors=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    report(results, args.rounds)


if __name__ == "__main__":
    main()
