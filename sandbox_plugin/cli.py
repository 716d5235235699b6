"""``sandbox-device-plugin``: the node's kubelet device plugins in one process."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
from pathlib import Path

from katamgr.errors import ConfigError, KatamgrError
from katamgr.host import inventory
from katamgr.host import naming as resource_naming
from katamgr.host import selection as device_selection
from katamgr.host.metrics_server import MetricsServer, parse_address
from katamgr.host.naming import Naming
from katamgr.host.process import (
    add_log_format_argument,
    report_error,
    setup_logging,
    stop_on_signals,
)
from katamgr.host.root import HostRoot
from katamgr.host.workload import (
    AUTO,
    WORKLOAD_LABEL,
    WORKLOADS,
    NoCluster,
    Workload,
    resolve_workload,
)
from sandbox_plugin.container import DEVICE_LIST_STRATEGIES, parse_device_list_strategies
from sandbox_plugin.manager import Mode, PluginManager
from sandbox_plugin.metrics import PluginMetrics
from sandbox_plugin.server import PluginServerError

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
auto (default): the node label nvidia.com/gpu.workload.config, read through the
  Kubernetes API (in-cluster, else kubeconfig) when --node-name or NODE_NAME is
  set; a node without the label runs --default-workload. Without that option, or
  with no node name or no cluster credentials, what the host shows decides (an
  NVIDIA GPU on vfio-pci -> vm-passthrough, otherwise container). A label value
  that is not a workload mode exits 2 and a failed read exits 1: neither is
  guessed around. katamgr --workload auto follows the same rule (its fallback:
  vm-passthrough). A vm-vgpu node is served by NVIDIA's vGPU device manager:
  this plugin serves nothing there.

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


class UsageError(ConfigError):
    """Bad command-line input; exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sandbox-device-plugin",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host-root", default="/", metavar="DIR",
                        help="where the host's / is mounted (default: /; /host in a DaemonSet)")
    parser.add_argument("--mode", default=AUTO, choices=[AUTO, *(m.value for m in Mode)],
                        help="which plugins to run (default: auto)")
    parser.add_argument("--node-name", default=os.environ.get("NODE_NAME"), metavar="N",
                        help="this node's name, to read its workload label (default: $NODE_NAME)")
    parser.add_argument("--default-workload", choices=WORKLOADS, metavar="WORKLOAD",
                        help="with --mode auto, the workload of a node without the label: "
                             f"{', '.join(WORKLOADS)} (default: what the host shows)")
    resource_naming.add_arguments(parser)
    # The same selection as katamgr's (the chart passes both the same devices value).
    device_selection.add_arguments(parser)
    parser.add_argument("--device-list-strategy", action="append", default=[], metavar="S[,S]",
                        help="container mode: how Allocate names the GPUs, any of "
                             f"{', '.join(DEVICE_LIST_STRATEGIES)} (comma-separated or repeated; "
                             "default: envvar,cdi-cri; toolkit settings each needs: above)")
    parser.add_argument("--metrics-address", metavar="HOST:PORT",
                        help="serve /metrics (Prometheus), /healthz and /readyz there (default: off)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    add_log_format_argument(parser)
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def read_workload_label(node_name: str) -> str | None:
    """The node's workload label through the Kubernetes API (None when unset).

    Raises NoCluster without credentials (in-cluster or kubeconfig), and any
    error of the client when the API does not answer (unreachable, 403).
    """
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except config.ConfigException as exc:
            raise NoCluster(str(exc)) from exc
    with client.ApiClient() as api:
        node = client.CoreV1Api(api).read_node(node_name, _request_timeout=10)
    return (node.metadata.labels or {}).get(WORKLOAD_LABEL)


def mode_from_host(
    host: HostRoot, selection: device_selection.Selection = device_selection.DEFAULT_SELECTION,
) -> tuple[Mode, str]:
    inv = inventory.discover(host, selection)
    on_vfio = [d.bdf for d in inv.passthrough if d.on_vfio]
    if on_vfio:
        return Mode.VM_PASSTHROUGH, f"passthrough device(s) {', '.join(on_vfio)} are bound to vfio-pci"
    if selection.is_default:
        return Mode.CONTAINER, "no NVIDIA GPU is bound to vfio-pci"
    return Mode.CONTAINER, "no passthrough device (as --include-device/--exclude-device select) is bound to vfio-pci"


def decide_mode(
    host: HostRoot, node_name: str | None, read_label=read_workload_label,
    default: Workload | str | None = None,
    selection: device_selection.Selection = device_selection.DEFAULT_SELECTION,
) -> tuple[Mode | None, str]:
    """The mode for ``--mode auto`` and why; None means: nothing to serve here.

    The rule is ``katamgr.host.workload.resolve_workload``'s, with what the host
    shows as the fallback. Raises ConfigError for a label that names no workload
    and KatamgrError when the API was asked and did not answer.
    """
    def from_host() -> tuple[Workload, str]:
        mode, why = mode_from_host(host, selection)
        return Workload(mode.value), why

    resolved = resolve_workload(node_name, read_label, default=default, fallback=from_host)
    if resolved.workload is Workload.VM_VGPU:
        return None, f"{resolved.why}, which the vGPU device manager serves, not this plugin"
    return Mode(resolved.workload.value), resolved.why


def _build(args: argparse.Namespace) -> tuple[HostRoot, Naming]:
    root = Path(args.host_root)
    if not root.is_dir():
        raise UsageError(f"--host-root {args.host_root!r} is not a directory; pass where the "
                         "host's / is mounted")
    if args.metrics_address:
        try:
            parse_address(args.metrics_address)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    try:
        return HostRoot.at(root), resource_naming.from_arguments(args, device_selection.from_arguments(args))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _device_list_strategies(args: argparse.Namespace):
    try:
        return parse_device_list_strategies(args.device_list_strategy)
    except ValueError as exc:
        raise UsageError(f"--device-list-strategy: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(logging.DEBUG if args.verbose else logging.INFO, args.log_format)
    stop = threading.Event()
    try:
        host, naming = _build(args)
        strategies = _device_list_strategies(args)
        stop_on_signals(stop.set, log)  # from here on SIGTERM ends the run cleanly
        if args.mode == AUTO:
            mode, why = decide_mode(host, args.node_name, default=args.default_workload,
                                    selection=naming.selection)
        else:
            mode, why = Mode(args.mode), "chosen with --mode"
    except KatamgrError as exc:  # bad usage or configuration 2, the API not answering 1
        report_error(f"sandbox-device-plugin: error: {exc}", args.log_format, log)
        return exc.exit_code
    log.info("mode %s: %s", mode.value if mode else "none", why)
    if mode is None:
        def nothing() -> tuple[bool, str]:
            return True, f"nothing to serve: {why}"

        with _metrics(args, PluginMetrics().registry, nothing, nothing):
            _wait(stop)
        return 0

    manager = PluginManager(host, mode, naming=naming, device_list_strategies=strategies)
    try:
        with _metrics(args, manager.metrics.registry, manager.health, manager.readiness):
            manager.start()
            _wait(stop)
    except PluginServerError as exc:
        log.error("%s", exc)
        return 1
    finally:
        manager.stop()
    log.info("stopped")
    return 0


def _metrics(args: argparse.Namespace, registry, healthy, ready) -> contextlib.AbstractContextManager:
    if not args.metrics_address:
        return contextlib.nullcontext()
    return MetricsServer(args.metrics_address, registry, healthy=healthy, ready=ready)


def _wait(stop: threading.Event) -> None:
    # Short waits keep the main thread where signal handlers run responsive.
    while not stop.wait(1.0):
        pass


if __name__ == "__main__":
    sys.exit(main())
