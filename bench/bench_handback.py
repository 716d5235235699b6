"""Passthrough health on the simulated dgx-h100 node: the hand-back check per GPU (reset
through sysfs, read back: config space, link, AER), one health judgement per GPU (what the
device plugin's poll costs), and fault to Unhealthy at the kubelet (the simulator, over the
plugin's real gRPC) for an AER error and a GPU off the bus.

Target: hand-back check under 1 s per GPU. Prints figures; asserts nothing.
Run: .venv/bin/python bench/bench_handback.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from gpunode.host import handback, pcihealth, vfio
from gpunode.host.pciids import PciIds
from gpunode.policy.health import HealthPolicy
from gpunode.policy.naming import Naming
from katamgr.pipeline.plan import build_plan
from nodesim import pcierrors
from nodesim.kubelet import KubeletSimulator
from nodesim.materialise import materialise
from nodesim.node import open_node
from nodesim.profiles import find_profile
from sandbox_plugin.devhealth import DeviceHealth
from sandbox_plugin.manager import Mode, PluginManager


def figures(label: str, samples_ms: list[float]) -> None:
    ordered = sorted(samples_ms)
    p95 = ordered[max(0, int(len(ordered) * 0.95) - 1)]
    print(f"  {label}: p50 {statistics.median(ordered):.2f} ms, p95 {p95:.2f} ms, max {ordered[-1]:.2f} ms "
          f"({len(ordered)} samples)")


def main() -> None:
    naming = Naming(PciIds.find())
    with tempfile.TemporaryDirectory(prefix="bh-") as tmp:
        materialise(find_profile("dgx-h100"), Path(tmp) / "n")
        host = open_node(Path(tmp) / "n").host
        report = vfio.bind(host, build_plan(host, naming).decisions)
        assert not report.failures, report.failures
        gpus = [d.bdf for d in build_plan(host, naming).devices if d.kind == "gpu"]
        print(f"dgx-h100 (simulated): {len(gpus)} GPUs on vfio-pci")
        checks, judged = [], []
        for _ in range(10):
            for bdf in gpus:
                verdict = HealthPolicy().hand_back(host, bdf, None)
                assert verdict is not None and verdict.ok, verdict
                checks.append(verdict.seconds * 1000)
        figures("hand-back check per GPU (target < 1000 ms)", checks)
        health = DeviceHealth(host)
        for _ in range(50):
            for bdf in gpus:
                started = time.perf_counter()
                health.reason((bdf,), peek=True)
                judged.append((time.perf_counter() - started) * 1000)
        figures("health judgement per GPU (the plugin polls every 0.5 s)", judged)
        facts = [pcihealth.read_health(host, b) for b in gpus]
        print(f"  facts read: {facts[0].summary()}")
        fault_to_unhealthy(host, naming, gpus)


def fault_to_unhealthy(host, naming: Naming, gpus: list[str]) -> None:
    kubelet = KubeletSimulator(host)
    kubelet.start()
    manager = PluginManager(host, Mode.VM_PASSTHROUGH, naming=naming)
    manager.start()
    try:
        kubelet.wait_for(lambda s: sum(len(v) for v in s.devices.values()) >= len(gpus), timeout=30)
        for label, fault in (("AER fatal", lambda b: pcierrors.inject_aer(host, b, "fatal", "DLP")),
                             ("off the bus", lambda b: pcierrors.fall_off_bus(host, b))):
            samples = []
            for bdf in gpus:
                started = time.perf_counter()
                fault(bdf)
                kubelet.wait_for(lambda s, b=bdf: any(d.id == b and not d.healthy
                                                      for v in s.devices.values() for d in v), timeout=5)
                samples.append((time.perf_counter() - started) * 1000)
                verdict = HealthPolicy().hand_back(host, bdf, None)
                handback.write_verdict(host, verdict)
                kubelet.wait_for(lambda s, b=bdf: any(d.id == b and d.healthy
                                                      for v in s.devices.values() for d in v), timeout=5)
            figures(f"{label} to Unhealthy at ListAndWatch (simulated: no uevent, the 0.5 s poll)", samples)
    finally:
        manager.stop()
        kubelet.stop()


if __name__ == "__main__":
    main()
