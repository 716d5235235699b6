"""``katamgr demo``: the whole job on a simulated node, told as a short story.

Nothing on the machine running it is touched: the node is a temp dir made by the
simulated node (``nodesim``, handed in as ``gpunode.services.simulator`` finds it, never
imported) whose sysfs writes are answered by its emulated kernel, the Kata artifacts come
from an OCI layout shipped with katamgr, and the kubelet is a simulator speaking the real
device-plugin gRPC. The demo stands above both programs: it runs katamgr's pipeline here
and ``sandbox-device-plugin`` as the separate program it is on a node (``python -m
sandbox_plugin``), against that kubelet and Kata's cold-plug stand-in.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from gpunode.errors import ConfigError
from gpunode.host.files import write_atomic
from gpunode.host.pciids import PciIds
from gpunode.host.root import HostRoot
from gpunode.policy.inventory import discover
from gpunode.policy.naming import Naming
from gpunode.policy.passthrough import resource_units
from gpunode.services import nodecontext, options
from gpunode.services.simulator import Simulator
from katamgr.config import load_config
from katamgr.exitcodes import Exit
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.reconcile import Steps, full_plan, reconcile, revert_all
from katamgr.pipeline.report import Report
from katamgr.render import STORY, plan_text, print_report

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


def run_demo(args: argparse.Namespace, sim: Simulator) -> int:
    """The demo on ``sim``, the simulated node (``gpunode.services.simulator``) the command found."""
    profile = sim.profile(args.profile)
    try:
        # The release --kata-version types decides for the simulated node (its Kata is not looked for).
        naming = Naming(PciIds.find(), selection=options.selection_from(args),
                        nvswitch_rule=nodecontext.typed_rule(args))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    with contextlib.ExitStack() as stack:
        if args.keep:
            root = Path(args.keep)
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kdemo-"))) / "host"
        host = sim.materialise(args.profile, root)
        prepare_node(host)
        steps = Steps()
        ctx = KataContext(load_config(DATA / "demo" / "kata-manager.yaml"))
        print(f"katamgr demo: simulated node {profile.name!r} in {host.root}")
        print(f"  {profile.description}")
        print("  Nothing on this machine is touched: sysfs writes go to an emulated kernel,")
        print("  Kata artifacts come from an OCI layout on the simulated node, and the kubelet is simulated.")

        _step("1. Plan (katamgr plan --config kata-manager.yaml)")
        plan = full_plan(host, naming, steps, ctx)
        print(plan_text(plan))

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
        plugin_ok = _device_plugin(sim, host, naming, args)

        _step("5. Revert (katamgr revert --config kata-manager.yaml)")
        undone = revert_all(host, steps, ctx)
        _print(undone)
        same = host.path("/etc/containerd/config.toml").read_text() == original
        print(f"  containerd config byte-identical to before: {'yes' if same else 'NO'}")
        if args.keep:
            print(f"\nThe simulated node is kept in {host.root}; try: katamgr plan --host-root {host.root}")
        return _verdict(plan.problems, plugin_ok=plugin_ok, reverted=undone.ok, same=same)


def _verdict(problems: list[str], *, plugin_ok: bool, reverted: bool, same: bool) -> Exit:
    """The demo's exit code, and why it is not 0 in one line on stderr (katamgr.exitcodes)."""
    why = []
    if not reverted:
        why.append("the revert failed (its errors are above)")
    if not same:
        why.append("the revert did not restore containerd's config byte for byte")
    if why:
        print(f"katamgr demo: {'; '.join(why)}", file=sys.stderr)
        return Exit.FAILED
    if not plugin_ok:
        cause = f": {' '.join(problems)}" if problems else " (the plugin's output is above)"
        print(f"katamgr demo: no GPU of the simulated node could be offered to a pod{cause}", file=sys.stderr)
        return Exit.PROBLEMS if problems else Exit.FAILED
    return Exit.OK


def _device_plugin(sim: Simulator, host: HostRoot, naming: Naming, args: argparse.Namespace, *,
                   gpus: int = 2) -> bool:
    """What a kubelet sees of the node: the plugin's registrations, the devices it lists,
    an allocation for a pod, and what Kata's cold-plug makes of it."""
    units = resource_units(host, discover(host, naming.selection, naming.nvswitch_rule), naming)
    names = sorted({u.resource_name for u in units})
    with tempfile.TemporaryFile("w+") as output, sim.kubelet(host) as kubelet, \
            _plugin_program(host, args, output):
        try:
            state = kubelet.wait_for(
                lambda s: all(s.registrations_for(n) and n in s.devices for n in names), timeout=15)
        except TimeoutError:
            output.seek(0)
            print("  the device plugin did not register every resource in 15 s; it said:")
            for line in output.read().splitlines()[-20:]:
                print(f"    {line}")
            return False
        for name in names:
            registration = state.registrations_for(name)[-1]
            print(f"  registered {name} (endpoint {registration.endpoint}, {registration.version}): "
                  f"{len(state.healthy(name))} healthy of {len(state.devices[name])}")
        gpu = _gpu_resource(host, naming, names)
        if gpu is None:
            print("  no passthrough resource to allocate from")
            return False
        count = min(gpus, len(state.healthy(gpu)))
        answers = kubelet.admit_pod("default", "cuda-vectoradd-kata", {"cuda": {gpu: count}})
        (chosen,) = [p.containers[0].devices[gpu] for p in kubelet.state.pods]
        answer = answers["cuda"][gpu]
        print(f"  pod default/cuda-vectoradd-kata asks for {count} {gpu}: GetPreferredAllocation, then")
        print(f"  Allocate({', '.join(chosen)}) ->")
        for spec in answer.devices:
            print(f"    device node {spec.host_path} ({spec.permissions})")
        for key, value in sorted(answer.envs.items()):
            print(f"    env {key}={value}")
        for device in answer.cdi_devices:
            print(f"    CDI device {device.name}")
        print("  Kata cold-plug at sandbox creation (PodResources Get -> CDI names -> VFIO nodes -> QEMU):")
        try:
            plug = sim.cold_plug(host, kubelet.pod_resources_socket, "default", "cuda-vectoradd-kata")
        except sim.cold_plug_error as exc:
            print(f"    FAILED: {exc}")
            return False
        for name in plug.cdi_names:
            print(f"    resolved {name}")
        print(f"    device nodes {' '.join(plug.device_nodes)}")
        print(f"    qemu {' '.join(plug.qemu_args)}")
        return bool(answer.devices) and len(plug.functions) >= count


def _gpu_resource(host: HostRoot, naming: Naming, names: list[str]) -> str | None:
    """A GPU resource if there is one, else any passthrough resource (an included device's)."""
    inv = discover(host, naming.selection, naming.nvswitch_rule)
    wanted = {naming.resource(d) for d in inv.gpus} or {naming.resource(d) for d in inv.passthrough}
    return next((n for n in names if n in wanted), None)


@contextlib.contextmanager
def _plugin_program(host: HostRoot, args: argparse.Namespace, output) -> Iterator[None]:
    """``sandbox-device-plugin`` serving the node with the demo's device selection until the
    block ends, then stopped as the kubelet's pod would be (SIGTERM; killed after 10 s)."""
    selection = [*(f"--include-device={v}" for v in args.include_device or ()),
                 *(f"--exclude-device={v}" for v in args.exclude_device or ())]
    plugin = subprocess.Popen(
        [sys.executable, "-m", "sandbox_plugin", "--host-root", str(host.root),
         "--workload", "vm-passthrough", *selection],
        stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT)
    try:
        yield
    finally:
        plugin.terminate()
        try:
            plugin.wait(timeout=10)
        except subprocess.TimeoutExpired:
            plugin.kill()
            plugin.wait()
