"""PCI scan time on a generated host: 16 GPUs among 2,000 PCI devices.

Target: scan under 100 ms. Prints figures; asserts nothing.
Run: .venv/bin/python bench/bench_scan.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from gpunode.host import pci
from gpunode.host.pciids import PciIds
from gpunode.policy.inventory import discover
from gpunode.policy.naming import Naming
from katamgr.pipeline.plan import build_plan
from nodesim.materialise import materialise
from nodesim.profile import parse_profile


def generated_profile(total: int = 2000, gpus: int = 16) -> dict:
    devices = []
    group = 0
    for i in range(total):
        bus, slot, fn = divmod(i, 32 * 8)[0] + 1, (i // 8) % 32, i % 8
        bdf = f"0000:{bus:02x}:{slot:02x}.{fn}"
        if fn == 0 and (i // 8) % (total // 8 // gpus) == 0 and sum(d["vendor"] == 0x10DE for d in devices) < gpus:
            kind = {"vendor": 0x10DE, "device": 0x2330, "class": 0x030200, "driver": "nvidia"}
        else:
            kind = {"vendor": 0x8086, "device": 0x1000 + i % 500, "class": 0x020000, "driver": "ixgbe"}
        if fn == 0:
            group += 1
        devices.append({"bdf": bdf, **kind, "iommu_group": group, "numa_node": bus % 2})
    return {"name": "bench-2000", "iommu": True, "vfio_pci": "loaded", "devices": devices}


def timed(fn, rounds: int = 20) -> list[float]:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def main() -> None:
    profile = parse_profile(generated_profile())
    with tempfile.TemporaryDirectory() as tmp:
        host = materialise(profile, Path(tmp) / "host")
        gpus = sum(1 for d in pci.scan(host) if d.is_gpu)
        naming = Naming(PciIds.find())
        print(f"host: {len(profile.devices)} PCI devices, {gpus} GPUs")
        for label, fn in (
            ("pci.scan", lambda: pci.scan(host)),
            ("discover (scan + groups)", lambda: discover(host)),
            ("build_plan (all of plan)", lambda: build_plan(host, naming)),
        ):
            samples = timed(fn)
            print(f"{label:28s} median {statistics.median(samples):7.1f} ms   max {max(samples):7.1f} ms")
        print("target: pci.scan under 100 ms")


if __name__ == "__main__":
    main()
