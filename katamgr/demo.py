"""``katamgr demo``: the whole job on a simulated node, told as a short story."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

from katamgr.apply import apply_host, revert_host
from katamgr.host.pciids import PciIds
from katamgr.host.simulate import materialise
from katamgr.plan import Naming, build_plan
from katamgr.profiles import find_profile
from katamgr.render import plan_text


def _step(title: str) -> None:
    print(f"\n== {title}")


def run_demo(args: argparse.Namespace) -> int:
    profile = find_profile(args.profile)
    with contextlib.ExitStack() as stack:
        if args.keep:
            root = Path(args.keep)
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="katamgr-demo-"))) / "host"
        host = materialise(profile, root)
        naming = Naming(PciIds.find())
        print(f"katamgr demo: simulated node {profile.name!r} in {host.root}")
        print(f"  {profile.description}")
        print("  Nothing on this machine is touched: sysfs writes go to an emulated kernel.")

        _step("1. Plan (katamgr plan)")
        plan = build_plan(host, naming)
        print(plan_text(plan))

        _step("2. Apply (katamgr apply)")
        report = apply_host(host, plan)
        for change in report.changes:
            print(f"  changed: {change}")
        for failure in report.failures:
            print(f"  error: {failure}")
        if not report.ok:
            return 1

        _step("3. Apply again: nothing to do")
        again = apply_host(host, build_plan(host, naming))
        print("  " + ("no changes, as expected" if not again.changes else f"UNEXPECTED: {again.changes}"))

        _step("4. Result")
        after = build_plan(host, naming)
        for name, count in after.resources.items():
            print(f"  {name}: {count} schedulable")
        groups = sorted((p.name for p in host.path("/dev/vfio").iterdir() if p.name.isdigit()), key=int)
        print(f"  /dev/vfio groups: {', '.join(groups)}")

        _step("5. Revert (katamgr revert)")
        undone = revert_host(host)
        print(f"  {len(undone.changes)} changes undone; every device is back on its original driver")
        if args.keep:
            print(f"\nThe simulated node is kept in {host.root}; try: katamgr plan --host-root {host.root}")
        return 0 if undone.ok else 1
