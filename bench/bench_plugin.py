"""Device plugin figures on a simulated DGX-H100, against the targets of docs/performance.md.

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

Beside this script: plugincallers.py (the serial and paced Allocate callers) and
pluginkubelet.py (the kubelet's Registration server and timestamped ListAndWatch stream).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from plugincallers import Load, allocate_request, paced, serial  # noqa: E402 - beside this script
from pluginkubelet import HealthWatch, Kubelet  # noqa: E402 - beside this script
from support.registry_server import free_port  # noqa: E402

from gpunode.host.pciids import PciIds  # noqa: E402
from gpunode.host.root import HostRoot  # noqa: E402
from gpunode.policy.naming import resource_name  # noqa: E402
from sandbox_plugin.resources import HEALTHY, UNHEALTHY  # noqa: E402

PROFILE = "dgx-h100"
HEALTH_NODE, HEALTH_DEVICE = "/dev/vfio/16", "0000:13:00.0"

# (figure, target, NVIDIA's sandbox-device-plugin on the same node): the targets and NVIDIA's
# figures are docs/performance.md's (its serial p50 through grpcio's client, as here).
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


def proc_status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- one round -------------------------------------------------------------------------


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
                # part of its start-up and memory). No NVLink fabric: dgx-h100 runs Fabric
                # Manager in the Shared NVSwitch model, where a 2-GPU Allocate must name one
                # partition and activates it; the targets and NVIDIA's figures are for Allocate
                # without FM (bench_nvlink.py times the partitions).
                [sys.executable, "-m", "sandbox_plugin.cli", "--workload", "vm-passthrough",
                 "--nvlink-fabric", "off",
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
        watch = HealthWatch(socket, HEALTH_DEVICE)
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
    print(f"\nMedians of {rounds} round(s); NVIDIA's figures from docs/performance.md (same simulated node).")
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
