"""``katamgr demo``: the whole job on a simulated node, told as a short story.

Nothing on the machine running it is touched: the node is a temp dir made by
the simulator (``katamgr.simulator``) whose sysfs writes are answered by its
emulated kernel, the Kata artifacts come from an OCI layout shipped with
katamgr, and the kubelet is a simulator speaking the real device-plugin gRPC.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import shutil
import sys
import tempfile
from pathlib import Path

from katamgr.config import load_config
from katamgr.errors import ConfigError
from katamgr.host import selection as device_selection
from katamgr.host.files import write_atomic
from katamgr.host.naming import Naming
from katamgr.host.pciids import PciIds
from katamgr.host.root import HostRoot
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.reconcile import Steps, full_plan, reconcile, revert_all
from katamgr.pipeline.report import Report
from katamgr.render import STORY, plan_text, print_report
from katamgr.simulator.materialise import materialise
from katamgr.simulator.profiles import find_profile

DATA = Path(__file__).parent / "data"
LAYOUT_ON_NODE = "/opt/kata-artifacts/layout"


def _step(title: str) -> None:
    print(f"\n== {title}")


def _print(report: Report) -> None:
    print_report(report, prefixes=STORY, errors=sys.stdout)  # the story is told on stdout


def prepare_node(host: HostRoot) -> None:
    """What an air-gapped node has before katamgr: containerd config, an artifact layout."""
    write_atomic(host.path("/etc/containerd/config.toml"), (DATA / "demo" / "containerd-config.toml").read_text())
    shutil.copytree(DATA / "oci-layout", host.path(LAYOUT_ON_NODE))


def run_demo(args: argparse.Namespace) -> int:
    profile = find_profile(args.profile)
    try:
        naming = Naming(PciIds.find(), selection=device_selection.from_arguments(args))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    with contextlib.ExitStack() as stack:
        if args.keep:
            root = Path(args.keep)
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kdemo-"))) / "host"
        host = materialise(profile, root)
        prepare_node(host)
        steps = Steps()
        ctx = KataContext(load_config(DATA / "demo" / "kata-manager.yaml"))
        print(f"katamgr demo: simulated node {profile.name!r} in {host.root}")
        print(f"  {profile.description}")
        print("  Nothing on this machine is touched: sysfs writes go to an emulated kernel,")
        print("  Kata artifacts come from an OCI layout on the simulated node, and the kubelet is simulated.")

        _step("1. Plan (katamgr plan --config kata-manager.yaml)")
        print(plan_text(full_plan(host, naming, steps, ctx)))

        _step("2. Apply (katamgr apply --config kata-manager.yaml)")
        report = reconcile(host, naming, steps, ctx)
        _print(report)
        if not report.ok:
            return 1
        original = (DATA / "demo" / "containerd-config.toml").read_text()
        now = host.path("/etc/containerd/config.toml").read_text()
        print("\n  containerd config diff (/etc/containerd/config.toml):")
        for line in difflib.unified_diff(original.splitlines(), now.splitlines(), "before", "after", lineterm="", n=1):
            print(f"    {line}")

        _step("3. Apply again: nothing to do, containerd not restarted")
        again = reconcile(host, naming, steps, ctx)
        print("  " + ("no changes, as expected" if not again.changes else f"UNEXPECTED: {again.changes}"))

        _step("4. The device plugin, as the kubelet sees it")
        plugin_ok = _device_plugin(host, naming)

        _step("5. Revert (katamgr revert --config kata-manager.yaml)")
        undone = revert_all(host, steps, ctx)
        _print(undone)
        same = host.path("/etc/containerd/config.toml").read_text() == original
        print(f"  containerd config byte-identical to before: {'yes' if same else 'NO'}")
        if args.keep:
            print(f"\nThe simulated node is kept in {host.root}; try: katamgr plan --host-root {host.root}")
        return 0 if (undone.ok and same and plugin_ok) else 1


def _device_plugin(host: HostRoot, naming: Naming) -> bool:
    try:
        from sandbox_plugin.demo import show_device_plugin
    except ImportError as exc:  # the plugin package is part of this distribution
        print(f"  (device plugin not available: {exc})")
        return True
    return show_device_plugin(host, naming)
