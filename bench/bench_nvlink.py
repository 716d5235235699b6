"""NVLink partition figures on a simulated Shared NVSwitch node, against docs/performance.md's targets.

    .venv/bin/python bench/bench_nvlink.py [--rounds 20] [--releases 3]

dgx-h100 (8 H100 SXM5, 4 NVSwitches, Fabric Manager in the Shared NVSwitch model: the stand-in
libnvfm of nodesim/fabricmanager, its state behind the simulated node's socket) is bound to
vfio-pci with katamgr's apply; the device plugin runs in this process (PluginManager, its real
gRPC server on its unix socket) with the node's FM, and the kubelet simulator calls it through
grpcio as a kubelet would. Each round:

  - Allocate of a 2-GPU partition: timed around the kubelet's Allocate call, which activates
    the partition (fmActivateFabricPartition) before it answers; then the partition is
    released (the kubelet lists no pod for it) so the next round activates again;
  - the same Allocate on the same node with the plugin given no fabric (no FM call): what the
    activation adds.

Then, --releases times: a 2-GPU pod admitted, left past the plugin's grace for a pod being
admitted, removed from the kubelet; timed until FM reports its partition inactive.

Prints medians next to the targets (our share of a 2-GPU pod's start, activation included,
within 100 ms; the partition deactivated within 2 s of the pod's end); asserts nothing.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpunode.host.pciids import PciIds  # noqa: E402
from gpunode.policy.naming import Naming, resource_name  # noqa: E402
from gpunode.services import nvlinkfabric as nf  # noqa: E402
from katamgr.pipeline.devices import apply_host  # noqa: E402
from katamgr.pipeline.plan import build_plan  # noqa: E402
from nodesim import fabricmanager as fmsim  # noqa: E402
from nodesim.kubelet import KubeletSimulator  # noqa: E402
from nodesim.materialise import materialise  # noqa: E402
from nodesim.node import open_node  # noqa: E402
from nodesim.profiles import find_profile  # noqa: E402
from sandbox_plugin import fabric  # noqa: E402
from sandbox_plugin.manager import Mode, PluginManager  # noqa: E402

PAIR = ["0000:03:00.0", "0000:13:00.0"]  # modules 1 and 3: partition 3


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:7.2f} ms (min {min(values) * 1000:.2f}, max {max(values) * 1000:.2f})"


def run(rounds: int, releases: int) -> None:
    pci_ids = PciIds.find()
    h100 = resource_name(pci_ids, 0x10DE, 0x2330)
    naming = Naming(pci_ids)
    directory = tempfile.mkdtemp(prefix="bn-")
    kubelet = None
    manager = None
    try:
        host = materialise(find_profile("dgx-h100"), directory)
        assert apply_host(host, build_plan(host, naming)).ok
        kubelet = KubeletSimulator(host)
        kubelet.start()
        library, socket, modules = open_node(host.root).fabric_manager()
        guard = fabric.FabricGuard(host, nf.FabricSettings(nf.SHARED, socket, library, modules),
                                   given=lambda: set())
        with_fm, without = [], []
        for use_fabric in (True, False):
            manager = PluginManager(host, Mode.VM_PASSTHROUGH, naming=naming,
                                    fabric=guard if use_fabric else None)
            manager.start()
            kubelet.wait_for(lambda s: len(s.healthy(h100)) == 8)
            kubelet.allocate(h100, PAIR)  # a warm channel and a warm plugin
            guard.release_unheld()
            for _ in range(rounds):
                started = time.perf_counter()
                kubelet.allocate(h100, PAIR)
                (with_fm if use_fabric else without).append(time.perf_counter() - started)
                if use_fabric:
                    assert fmsim.active(host.root) == [3]
                    fabric.GRACE = 0.0
                    guard.release_unheld()
                    fabric.GRACE = 5.0
            manager.stop()
            manager = None
        print(f"Allocate, 2 GPUs, activation included:   {ms(with_fm)}   target: within 100 ms")
        print(f"Allocate, 2 GPUs, no fabric (baseline):  {ms(without)}")

        fabric.RELEASE_INTERVAL = 1.0
        manager = PluginManager(host, Mode.VM_PASSTHROUGH, naming=naming,
                                fabric=fabric.FabricGuard(host, nf.FabricSettings(nf.SHARED, socket, library,
                                                                                  modules)))
        manager.start()
        kubelet.wait_for(lambda s: len(s.healthy(h100)) == 8)
        gone = []
        for i in range(releases):
            kubelet.admit_pod("default", f"pod{i}", {"c": {h100: 2}})
            time.sleep(fabric.GRACE + 0.2)
            kubelet.remove_pod("default", f"pod{i}")
            ended = time.perf_counter()
            while fmsim.active(host.root):
                time.sleep(0.01)
            gone.append(time.perf_counter() - ended)
        print(f"pod ended -> partition deactivated:      {ms(gone)}   target: within 2 s")
    finally:
        if manager is not None:
            manager.stop()
        if kubelet is not None:
            kubelet.stop()
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--releases", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("sandbox_plugin").setLevel(logging.ERROR)  # the spec-less answers' warnings
    run(args.rounds, args.releases)


if __name__ == "__main__":
    main()
