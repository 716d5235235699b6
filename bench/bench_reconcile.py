"""A reconcile with nothing to do, on a simulated DGX-H100-like node with the Kata chain.

Targets: no writes, no containerd restart, under 1 s.
Prints figures; asserts nothing. Run: .venv/bin/python bench/bench_reconcile.py
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

from gpunode.host.pciids import PciIds
from gpunode.policy.naming import Naming
from katamgr.config import load_config
from katamgr.demo import DATA, prepare_node
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.reconcile import Steps, reconcile
from nodesim.materialise import materialise
from nodesim.profiles import find_profile


def stamps(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.join(dirpath, name)] = (st.st_ino, st.st_mtime_ns)
    return out


def main(rounds: int = 20) -> None:
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        host = materialise(find_profile("dgx-h100"), Path(tmp) / "host")
        prepare_node(host)
        naming = Naming(PciIds.find())
        ctx = KataContext(load_config(DATA / "demo" / "kata-manager.yaml"))
        first = reconcile(host, naming, Steps(), ctx)
        print(f"first reconcile: {len(first.changes)} changes")
        before = stamps(host.root)
        samples, changes = [], 0
        for _ in range(rounds):
            start = time.perf_counter()
            report = reconcile(host, naming, Steps(), ctx)
            samples.append((time.perf_counter() - start) * 1000)
            changes += len(report.changes)
        after = stamps(host.root)
        touched = sorted(p for p in after if before.get(p) != after[p])
        print(f"no-change reconcile ({rounds} rounds): median {statistics.median(samples):.1f} ms, "
              f"max {max(samples):.1f} ms  (target < 1000 ms)")
        print(f"changes reported: {changes}; files written: {len(touched)} (target 0)")
        for path in touched[:10]:
            print(f"  written: {path}")


if __name__ == "__main__":
    main()
