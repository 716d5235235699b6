"""``sandbox-device-plugin``: the node's kubelet device plugins in one process."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import threading
import time

from gpunode.errors import GpuNodeError
from gpunode.host.root import HostRoot
from gpunode.policy import selection as device_selection
from gpunode.policy.workload import AUTO, NoCluster, Resolution, Workload
from gpunode.services import options
from gpunode.services.nodecontext import NodeContext, WorkloadRule
from gpunode.services.process import (
    report_error,
    setup_logging,
    stop_on_signals,
)
from gpunode.services.simulator import NodeExtras
from sandbox_plugin.commands import (
    UsageError,
    cluster_client,
    mode_from_host,
    node_context,
    read_labels,
)
from sandbox_plugin.container import DEVICE_LIST_STRATEGIES, parse_device_list_strategies
from sandbox_plugin.fabricgate import FabricGate, gate_for
from sandbox_plugin.follow import ALL_MODES, LabelFollower, PluginRunner, mode_for
from sandbox_plugin.manager import Mode, PluginManager
from sandbox_plugin.served import PluginServerError
from sandbox_plugin.splitshare import SplitShare

log = logging.getLogger("sandbox_plugin")

DESCRIPTION = """\
Advertise a node's NVIDIA GPUs to the kubelet as device plugins.

vm-passthrough: every GPU and NVSwitch bound to vfio-pci, one resource per model
  (nvidia.com/GA102GL_A10, ...) or one alias resource (--alias pgpu ->
  nvidia.com/pgpu); one device per IOMMU group; Allocate hands out the VFIO
  device nodes, PCI_RESOURCE_<RESOURCE> and, when a CDI spec on the host defines them,
  the CDI names (nvidia.com/pgpu=0, from the spec katamgr writes with CDI enabled).
  Devices bound or unbound later are picked up without a restart. Which devices
  are passthrough devices: --include-device VENDOR:DEVICE=RESOURCE adds devices
  advertised as RESOURCE (e.g. 1234:11e8=example.com/edu), --exclude-device
  BDF|VENDOR:DEVICE leaves one out; give the plugin the same as katamgr.
container: nvidia.com/gpu from NVML, device IDs are GPU UUIDs; without NVML
  nothing is advertised and the plugin waits.
--workload auto (the default): serve what the Node's label
  nvidia.com/gpu.workload.config asks for, and follow it live (--workload
  vm-passthrough or container serves that mode; --mode is its deprecated
  spelling). With --node-name or NODE_NAME and a cluster to ask (in-cluster,
  else kubeconfig) the plugin reads the Node, then watches it (field selector
  metadata.name=<node>; read every 10 s while a watch fails) and switches
  plugins within a second or two of a relabel, without a restart. A node
  without the label runs --default-workload (default container, as the GPU
  Operator's sandboxWorkloads.defaultWorkload). Without a node name or cluster
  credentials, what the host shows
  decides, once: any selected passthrough device (an NVIDIA GPU or NVSwitch, or
  a device --include-device adds, less --exclude-device) on vfio-pci ->
  vm-passthrough, otherwise container. At start, a Node that cannot be read
  exits 1 and a label value that is not a workload mode exits 2: neither is
  guessed around. Later, while following, either is logged and the current
  mode kept until the label reads well again.
  The GPU Operator's opt-out labels are followed the same way (only "false"
  counts): nvidia.com/gpu.deploy.sandbox-device-plugin=false or
  nvidia.com/gpu.deploy.kata-sandbox-device-plugin=false: no passthrough
  resources; nvidia.com/gpu.deploy.device-plugin=false: no nvidia.com/gpu;
  nvidia.com/gpu.deploy.operands=false: neither.
  --auto-modes limits the modes this plugin serves: on a node whose workload
  asks for another it advertises nothing (the chart passes --auto-modes
  vm-passthrough; its container plugin DaemonSet serves container nodes).
  katamgr --workload auto follows the same rule (its fallback: vm-passthrough).
  A vm-vgpu node is served by NVIDIA's vGPU device manager: this plugin serves
  nothing there.

Device-list strategies (container mode, --device-list-strategy; comma-separated
or repeated; default envvar,cdi-cri): how Allocate names the GPUs to the NVIDIA
Container Toolkit, and the toolkit settings (/etc/nvidia-container-runtime/
config.toml) each needs:
  envvar           NVIDIA_VISIBLE_DEVICES=<uuid,...>. Unprivileged pods get their
                   GPUs only with accept-nvidia-visible-devices-envvar-when-
                   unprivileged = true (the toolkit's default), which also lets
                   any pod pick GPUs by setting the variable itself.
  volume-mounts    /dev/null mounted at /var/run/nvidia-container-devices/<uuid>
                   per GPU, NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices
                   (replaces envvar's value). Needs
                   accept-nvidia-visible-devices-as-volume-mounts = true; then
                   accept-nvidia-visible-devices-envvar-when-unprivileged = false
                   closes the variable to pods: the safest with the toolkit's
                   runtime or hook.
  cdi-annotations  annotation cdi.k8s.io/sandbox-device-plugin_<digest> listing
                   nvidia.com/gpu=<uuid>. Needs CDI in the runtime (containerd
                   1.7+ enable_cdi = true, default in 2.0; CRI-O) or the toolkit's
                   runtime in cdi mode, and a CDI spec naming GPUs by UUID
                   (nvidia-ctk cdi generate --device-name-strategy=uuid).
  cdi-cri          the same names in the Allocate answer's CDIDevices field.
                   Needs kubelet 1.29+ (DevicePluginCDIDevices) besides what
                   cdi-annotations needs.
  Both CDI strategies hand out only names a spec in /etc/cdi or /var/run/cdi
  defines (an undefined name fails the pod).

Stops cleanly (sockets removed, exit 0) on SIGTERM or SIGINT.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sandbox-device-plugin",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    options.add_version(parser)
    options.add_node_options(parser)  # as katamgr and the DRA driver take them
    # Manifests written before --workload say --mode: it still works, and warns.
    parser.add_argument("--mode", dest="workload", choices=options.WORKLOAD_CHOICES,
                        action=options.DeprecatedAlias, instead="--workload",
                        help="deprecated spelling of --workload")
    parser.add_argument("--auto-modes", type=_modes, default=ALL_MODES, metavar="MODE[,MODE]",
                        help="with --workload auto, the modes this plugin may serve (default: "
                             "vm-passthrough,container); on a node whose workload asks for another "
                             "it advertises nothing (another plugin serves it)")
    options.add_containerd_config(parser)
    parser.add_argument("--device-list-strategy", action="append", default=[], metavar="S[,S]",
                        help="container mode: how Allocate names the GPUs, any of "
                             f"{', '.join(DEVICE_LIST_STRATEGIES)} (comma-separated or repeated; "
                             "default: envvar,cdi-cri; toolkit settings each needs: above)")
    parser.add_argument("--stop-grace", type=_seconds, default=0.0, metavar="SECONDS",
                        help="on SIGTERM keep serving the kubelet until katamgr beside it has taken the "
                             "node's runtime-class offer labels off and the kubelet has taken the pods bound "
                             "before (katamgr run --offer-gate), at most SECONDS (default 0: stop at once)")
    options.add_metrics_address(parser)
    options.add_verbose(parser, "log debug details")
    return parser


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 300:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of seconds from 0 to 300")
    return value


def _modes(text: str) -> frozenset[Mode]:
    try:
        return frozenset(Mode(m.strip()) for m in text.split(",") if m.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a comma-separated list of {', '.join(m.value for m in Mode)}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def decide_mode(
    host: HostRoot, node_name: str | None, read_labels=read_labels,
    default: Workload | str | None = None,
    selection: device_selection.Selection = device_selection.DEFAULT_SELECTION,
    modes: frozenset[Mode] = ALL_MODES,
    nvswitch_rule: device_selection.NvswitchRule = device_selection.DEFAULT_NVSWITCH_RULE,
) -> tuple[Mode | None, str]:
    """The mode for ``--workload auto`` and why; None means: nothing to serve here.

    The rule is ``gpunode.policy.workload.resolve_workload``'s, with what the host
    shows as the fallback, then ``follow.mode_for``'s (opt-outs, ``--auto-modes``).
    Raises ConfigError for a label that names no workload and GpuNodeError when the
    API was asked and did not answer.
    """
    return mode_for(_resolve(host, node_name, read_labels, default, selection, nvswitch_rule=nvswitch_rule), modes)


def _resolve(host: HostRoot, node_name: str | None, read_labels, default: Workload | str | None,
             selection: device_selection.Selection, rule: WorkloadRule | None = None, *,
             nvswitch_rule: device_selection.NvswitchRule = device_selection.DEFAULT_NVSWITCH_RULE) -> Resolution:
    """``rule`` (the node context's; None: ``auto`` for ``node_name`` with ``default``) with what
    the host shows as the fallback."""
    def from_host() -> tuple[Workload, str]:
        mode, why = mode_from_host(host, selection, nvswitch_rule)
        return Workload(mode.value), why

    rule = rule or WorkloadRule(node_name, AUTO, default)
    return rule.resolve(read_labels, from_host)


def _build(args: argparse.Namespace) -> NodeContext:
    """What runs before the plugins register: the options' checks and the node's context."""
    options.metrics_address(args)
    return node_context(args)


def _device_list_strategies(args: argparse.Namespace):
    try:
        return parse_device_list_strategies(args.device_list_strategy)
    except ValueError as exc:
        raise UsageError(f"--device-list-strategy: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(logging.DEBUG if args.verbose else logging.INFO, args.log_format)
    stop = threading.Event()
    watch = None
    try:
        node = _build(args)
        host, naming, extras = node.host, node.naming, node.extras
        strategies = _device_list_strategies(args)
        signalled: list[float] = []

        def on_stop() -> None:
            signalled.append(time.time())
            stop.set()

        stop_on_signals(on_stop, log)  # from here on SIGTERM ends the run cleanly
        # What the node brings (gpunode.services.simulator): a simulated node its own NVML
        # (answering from the node's sysfs and, as NVML, listing again only when started
        # again: the driver watch does that), its Fabric Manager and its kubeconfig rule.
        nvml = extras.nvml() if extras.nvml is not None else None
        fabric = _fabric_gate(node)
        runner = PluginRunner(lambda m, metrics, held_only=False: PluginManager(
            host, m, naming=naming, device_list_strategies=strategies, metrics=metrics, nvml=nvml,
            held_only=held_only, fabric=fabric, link_policy=node.link_policy))
        held = False
        follower = None
        if not node.workload.follows:
            mode, why = mode_for(node.workload.resolve(None))
        else:
            watch = _label_watch(args, extras)
            if watch is None:
                mode, why = decide_mode(host, args.node_name,
                                        lambda name: read_labels(name, extras),
                                        default=args.default_workload,
                                        selection=naming.selection, modes=args.auto_modes,
                                        nvswitch_rule=naming.nvswitch_rule)
            else:
                # Followed live: a relabel switches the plugins without a restart.
                follower = LabelFollower(runner, lambda: _resolve(
                    host, args.node_name, lambda _node: watch.labels(), args.default_workload,
                    naming.selection, node.workload, nvswitch_rule=naming.nvswitch_rule), args.auto_modes)
                watch.on_change = follower.changed.set
                runner.share = SplitShare(host)  # a split node's sides, as katamgr publishes them
                mode, why, held = follower.first()
    except GpuNodeError as exc:  # bad usage or configuration 2, the API not answering 1
        if watch is not None:
            watch.stop()
        report_error(f"sandbox-device-plugin: error: {exc}", args.log_format, log)
        return exc.exit_code
    try:
        runner.serve(mode, why, held)
        # After the plugins registered: the kubelet waits for them, while the probes
        # (startupProbe: a minute) wait well for the HTTP server and prometheus_client.
        with _metrics(args, runner.metrics, runner.health, runner.readiness):
            _wait(stop, follower)
            if signalled and args.stop_grace > 0:
                _stand_down(host, signalled[0], args.stop_grace)
    except PluginServerError as exc:
        log.error("%s", exc)
        return 1
    finally:
        runner.stop()
        if watch is not None:
            watch.stop()
    log.info("stopped")
    return 0


def _stand_down(host: HostRoot, since: float, grace: float) -> None:
    """Told to stop: the plugin's stream ending makes the kubelet refuse every pod it admits
    until the next plugin registers (gpunode.host.standdown), so it serves on until katamgr
    says the offers are off and the pods bound before are the kubelet's, at most ``grace``."""
    from gpunode.host import standdown

    log.info("stopping: serving on until the runtime-class offers are withdrawn (at most %g s)", grace)
    if standdown.wait_withdrawn(host, since, grace):
        log.info("the runtime-class offers are withdrawn: stopping")
    else:
        log.warning("no word of the runtime-class offers being withdrawn within %g s: stopping", grace)


def _fabric_gate(node: NodeContext) -> FabricGate | None:
    """The NVSwitch board's model (``sandbox_plugin.fabricgate``) as the node's context decided
    it: None without NVSwitches or with ``--nvlink-fabric off``; a gate withholding the board's
    GPUs where neither model holds."""
    from gpunode.policy.inventory import discover

    naming = node.naming
    return gate_for(node.host, node.fabric, discover(node.host, naming.selection, naming.nvswitch_rule),
                    choice=node.fabric_choice)


def _label_watch(args: argparse.Namespace, extras: NodeExtras):
    """A started watch on this node's labels, or None without a node name or a cluster."""
    if not args.node_name:
        return None
    try:
        api = cluster_client(extras)
    except NoCluster:
        return None
    from gpunode.services.kube import NodeLabelWatch

    return NodeLabelWatch(api, args.node_name).start()


def _metrics(args: argparse.Namespace, metrics, healthy, ready) -> contextlib.AbstractContextManager:
    if not args.metrics_address:
        return contextlib.nullcontext()
    # Loaded only here: the HTTP server and prometheus_client cost start-up time.
    from gpunode.services.metrics_server import MetricsServer

    return MetricsServer(args.metrics_address, metrics.registry, healthy=healthy, ready=ready)


def _wait(stop: threading.Event, follower: LabelFollower | None = None) -> None:
    # Short waits keep the main thread where signal handlers run responsive; a follower
    # is checked as soon as its watch says the labels changed, and every 30 s regardless.
    last = time.monotonic()
    while not stop.is_set():
        if follower is None:
            stop.wait(1.0)
            continue
        woken = follower.changed.wait(0.2)
        if stop.is_set():
            return
        follower.poll_split()  # a split node's sides, as katamgr moves GPUs between them
        if woken or time.monotonic() - last >= 30:
            follower.changed.clear()
            last = time.monotonic()
            follower.check()


if __name__ == "__main__":
    sys.exit(main())
