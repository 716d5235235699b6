"""Device plugin figures on a simulated DGX-H100, against the targets of issue 21.

    .venv/bin/python bench/bench_plugin.py [--rounds 5] [--baseline DIR] [--serial 2000]
        [--callers 100] [--rate 10] [--seconds 4] [--client-procs 4] [--flips 20]

The plugin runs as a kubelet meets it: its own process (``sandbox-device-plugin
--mode vm-passthrough``, started fresh each round), talking over its unix
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
  - Allocate of 1 H100, serial: --serial calls back to back, timed in the caller
    around each call. The caller is as cheap as a caller gets, so what is timed
    is the plugin: one connection kept open, the request encoded once, the
    answer not decoded (``sandbox_plugin.wire.client.Channel``, a raw HTTP/2
    client). The same calls through grpcio's Python client are printed too, for
    scale: that client alone costs about 0.2 ms a call;
  - plugin CPU per Allocate: the plugin process's utime+stime
    (/proc/<pid>/stat) over the serial calls, divided by their number;
  - Allocate with --callers callers at --rate calls/s each (1 or 2 H100s per
    call, each caller starting at a random point of its period), --seconds long:
    callers spread over --client-procs processes, each on its own connection,
    driven by one event loop per process (no thread has to be woken to see its
    answer), each call timed from its send to its end arriving;
  - memory and threads of the plugin after those loads (/proc/<pid>/status
    VmRSS, Threads);
  - health: ``dev/vfio/16`` deleted, timed until the ListAndWatch stream (read
    in a thread of its own that timestamps each message as it arrives) carries
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

from katamgr.host.naming import resource_name  # noqa: E402
from katamgr.host.pciids import PciIds  # noqa: E402
from katamgr.host.root import HostRoot  # noqa: E402
from sandbox_plugin.resources import HEALTHY, UNHEALTHY  # noqa: E402

PROFILE = "dgx-h100"
HEALTH_NODE, HEALTH_DEVICE = "/dev/vfio/16", "0000:13:00.0"
ALLOCATE = "/v1beta1.DevicePlugin/Allocate"
LIST_AND_WATCH = "/v1beta1.DevicePlugin/ListAndWatch"
REGISTER = "/v1beta1.Registration/Register"

# (figure, target, NVIDIA's sandbox-device-plugin on the same node: issue 21)
TARGETS = {
    "launch to first Register (ms)": (208.0, 208.0),
    "Allocate serial p50 (ms)": (0.25, 0.26),
    "Allocate serial p99 (ms)": (0.6, 0.57),
    "plugin CPU per Allocate (us)": (150.0, 145.0),
    "Allocate paced p50 (ms)": (None, 0.48),
    "Allocate paced p99 (ms)": (1.2, 1.12),
    "RSS after the loads (MiB)": (36.0, 36.0),
    "threads after the loads": (None, 7.0),
    "node removed -> Unhealthy p50 (ms)": (1.0, 0.93),
    "node removed -> Unhealthy max (ms)": (None, None),
    "node restored -> Healthy p50 (ms)": (None, None),
    "Allocate serial p50, grpcio client (ms)": (None, None),
}


def h100_name() -> str:
    return resource_name(PciIds.find(), 0x10DE, 0x2330)


def naming():
    from katamgr.host.naming import Naming

    return Naming(PciIds.find())


def simulated_dgx(root: str) -> HostRoot:
    """dgx-h100 bound to vfio-pci, with the CDI specs katamgr writes (cdi enabled)."""
    from katamgr.host.inventory import discover
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


class PacedCaller:
    """One caller on its own connection, driven by its process's event loop.

    Frames are read only for what ends a call (END_STREAM on its stream) and
    what the server must have answered (SETTINGS, PING): nothing is decoded,
    so the time a call takes is the plugin's, the socket's and the scheduler's.
    """

    def __init__(self, path: str, request: bytes) -> None:
        import socket as sockets

        from sandbox_plugin.wire import frames as f
        from sandbox_plugin.wire import hpack

        self.f = f
        self.sock = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
        self.sock.settimeout(10)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.sock.connect(path)
                break
            except BlockingIOError:  # the backlog is full: 100 callers connect at once
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.002)
        self.sock.sendall(f.PREFACE + f.settings({f.ENABLE_PUSH: 0, f.INITIAL_WINDOW_SIZE: f.MAX_WINDOW})
                          + f.window_update(0, f.MAX_WINDOW - f.DEFAULT_WINDOW))
        self.sock.setblocking(False)
        self.headers = hpack.encode([
            (b":method", b"POST"), (b":scheme", b"http"), (b":path", ALLOCATE.encode()),
            (b":authority", b"localhost"), (b"content-type", b"application/grpc"), (b"te", b"trailers")])
        self.body = f.message(request)
        self.stream = 1
        self.buf = bytearray()
        self.sent_at: float | None = None
        self.got_data = False
        self.due = False  # a call came due while the last was still out
        self.latencies: list[float] = []
        self.failures = 0

    def send(self) -> None:
        f = self.f
        self.got_data = False
        self.sent_at = time.perf_counter()
        self.sock.send(f.frame(f.HEADERS, f.END_HEADERS, self.stream, self.headers)
                       + f.frame(f.DATA, f.END_STREAM, self.stream, self.body))
        self.stream += 2

    def readable(self) -> None:
        """Read what came; note the latency of the call it ends, if it does."""
        f = self.f
        try:
            data = self.sock.recv(65536)
        except BlockingIOError:
            return
        now = time.perf_counter()
        if not data:
            raise ConnectionError("the plugin closed a caller's connection")
        self.buf += data
        while len(self.buf) >= 9:
            length, kind, flags, stream = f.parse_header(self.buf)
            if len(self.buf) < 9 + length:
                break
            payload = bytes(self.buf[9:9 + length])
            del self.buf[:9 + length]
            if kind == f.SETTINGS and not flags & f.ACK:
                self.sock.send(f.frame(f.SETTINGS, f.ACK, 0))
            elif kind == f.PING and not flags & f.ACK:
                self.sock.send(f.frame(f.PING, f.ACK, 0, payload))
            elif stream == self.stream - 2 and self.sent_at is not None:
                if kind == f.DATA and length:
                    self.got_data = True
                if flags & f.END_STREAM and kind in (f.DATA, f.HEADERS):
                    if self.got_data:
                        self.latencies.append(now - self.sent_at)
                    else:
                        self.failures += 1  # trailers only: an error status
                    self.sent_at = None
                    if self.due:
                        self.due = False
                        self.send()


def caller_process(socket: str, gpus: list[str], indexes: list[int], load: Load, gate, out) -> None:
    """Run the callers ``indexes`` on one event loop; put their latencies on ``out``."""
    import heapq
    import select

    try:
        callers = []
        for index in indexes:
            # Half the pods ask for one GPU, half for two.
            wanted = [gpus[index % len(gpus)]]
            if index % 2 == 0:
                wanted.append(gpus[(index + 1) % len(gpus)])
            callers.append(PacedCaller(socket, allocate_request(wanted)))
    except Exception:
        gate.abort()
        out.put(None)
        raise
    epoll = select.epoll()
    by_fd = {c.sock.fileno(): c for c in callers}
    for fd in by_fd:
        epoll.register(fd, select.EPOLLIN)
    interval = 1.0 / load.rate
    gate.wait()  # every process's callers are connected
    start = time.perf_counter()
    end = start + load.seconds
    due = [(start + random.uniform(0, interval), n) for n in range(len(callers))]
    heapq.heapify(due)
    while due or any(c.sent_at is not None for c in callers):
        timeout = max(0.0, due[0][0] - time.perf_counter()) if due else 0.05
        for fd, _events in epoll.poll(timeout):
            by_fd[fd].readable()
        now = time.perf_counter()
        while due and due[0][0] <= now:
            at, n = heapq.heappop(due)
            caller = callers[n]
            if caller.sent_at is None:
                caller.send()
            else:
                caller.due = True
            if at + interval < end:
                heapq.heappush(due, (at + interval, n))
    for caller in callers:
        caller.sock.close()
    if any(c.failures for c in callers):
        out.put(None)
        return
    out.put([x for c in callers for x in c.latencies])


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
        from kubeletapi.deviceplugin_paths import DEVICE_PLUGIN_DIR
        from sandbox_plugin.wire.server import GrpcServer

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
    """A ListAndWatch stream read in a thread, each message timestamped as it arrives."""

    def __init__(self, socket: Path) -> None:
        from sandbox_plugin.wire.client import Channel

        self._channel = Channel(str(socket))
        self._cond = threading.Condition()
        self.seen: list[tuple[float, str | None]] = []  # (perf_counter, health of HEALTH_DEVICE)
        self.healthy: list[str] = []  # in the latest list
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from kubeletapi import deviceplugin_pb2 as pb

        try:
            for message in self._channel.stream(LIST_AND_WATCH, b""):
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


def grpcio_serial(socket: Path, request: bytes, calls: int) -> list[float]:
    import grpc

    with grpc.insecure_channel(f"unix://{socket}") as channel:
        call = channel.unary_unary(ALLOCATE)  # bytes in, bytes out: no (de)serializing
        for _ in range(100):
            call(request, timeout=10)
        out = []
        for _ in range(calls):
            begin = time.perf_counter()
            call(request, timeout=10)
            out.append(time.perf_counter() - begin)
    return out


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
    from sandbox_plugin.wire.client import Channel

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
                [sys.executable, "-m", "sandbox_plugin.cli", "--mode", "vm-passthrough",
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

        request = allocate_request([HEALTH_DEVICE])
        with Channel(str(socket)) as channel:
            for _ in range(200):
                channel.call(ALLOCATE, request)
            latencies = []
            cpu_before = cpu_seconds(plugin.pid)
            for _ in range(args.serial):
                begin = time.perf_counter()
                channel.call(ALLOCATE, request)
                latencies.append(time.perf_counter() - begin)
            cpu = cpu_seconds(plugin.pid) - cpu_before
        figures["Allocate serial p50 (ms)"] = percentile(latencies, 0.5) * 1000
        figures["Allocate serial p99 (ms)"] = percentile(latencies, 0.99) * 1000
        figures["plugin CPU per Allocate (us)"] = cpu / args.serial * 1e6
        figures["Allocate serial p50, grpcio client (ms)"] = percentile(
            grpcio_serial(socket, request, args.serial // 2), 0.5) * 1000

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
    print(f"\nMedians of {rounds} round(s); NVIDIA's figures from issue 21 (same simulated node).")
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
    parser.add_argument("--client-procs", type=int, default=2, help="processes for the paced callers")
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
