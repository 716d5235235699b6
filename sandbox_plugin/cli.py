"""``sandbox-device-plugin``: the node's kubelet device plugins in one process."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from katamgr.host import inventory
from katamgr.host import naming as resource_naming
from katamgr.host.naming import Naming
from katamgr.host.root import HostRoot
from sandbox_plugin.manager import Mode, PluginManager
from sandbox_plugin.server import PluginServerError

log = logging.getLogger("sandbox_plugin")

WORKLOAD_LABEL = "nvidia.com/gpu.workload.config"
WORKLOAD_VALUES = ("container", "vm-passthrough", "vm-vgpu")

DESCRIPTION = """\
Advertise a node's NVIDIA GPUs to the kubelet as device plugins.

vm-passthrough: every GPU and NVSwitch bound to vfio-pci, one resource per model
  (nvidia.com/GA102GL_A10, ...) or one alias resource (--alias pgpu ->
  nvidia.com/pgpu); one device per IOMMU group; Allocate hands out the VFIO
  device nodes, PCI_RESOURCE_<RESOURCE> and, when a CDI spec on the host defines them,
  the CDI names (nvidia.com/pgpu=0, from the spec katamgr writes with CDI enabled).
  Devices bound or unbound later are picked up without a restart.
container: nvidia.com/gpu from NVML, device IDs are GPU UUIDs; without NVML
  nothing is advertised and the plugin waits.
auto (default): the node label nvidia.com/gpu.workload.config, read through the
  Kubernetes API (in-cluster, else kubeconfig) when --node-name or NODE_NAME is
  set; else what the host shows (an NVIDIA GPU on vfio-pci -> vm-passthrough,
  otherwise container).

Stops cleanly (sockets removed, exit 0) on SIGTERM or SIGINT.
"""


class UsageError(Exception):
    """Bad command-line input; exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sandbox-device-plugin",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host-root", default="/", metavar="DIR",
                        help="where the host's / is mounted (default: /; /host in a DaemonSet)")
    parser.add_argument("--mode", default="auto", choices=["auto", *(m.value for m in Mode)],
                        help="which plugins to run (default: auto)")
    parser.add_argument("--node-name", default=os.environ.get("NODE_NAME"), metavar="N",
                        help="this node's name, to read its workload label (default: $NODE_NAME)")
    resource_naming.add_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def read_workload_label(node_name: str) -> str | None:
    """The node's workload label through the Kubernetes API (None when unset).

    Raises any error of the client (no credentials, API unreachable, 403).
    """
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    with client.ApiClient() as api:
        node = client.CoreV1Api(api).read_node(node_name, _request_timeout=10)
    return (node.metadata.labels or {}).get(WORKLOAD_LABEL)


def mode_from_host(host: HostRoot) -> tuple[Mode, str]:
    inv = inventory.discover(host)
    on_vfio = [d.bdf for d in inv.gpus if d.on_vfio]
    if on_vfio:
        return Mode.VM_PASSTHROUGH, f"GPU(s) {', '.join(on_vfio)} are bound to vfio-pci"
    return Mode.CONTAINER, "no NVIDIA GPU is bound to vfio-pci"


def decide_mode(
    host: HostRoot, node_name: str | None, read_label=read_workload_label
) -> tuple[Mode | None, str]:
    """The mode for ``--mode auto`` and why; None means: nothing to serve here."""
    if node_name:
        try:
            value = read_label(node_name)
        except Exception as exc:  # any client failure: the host still tells us enough
            mode, why = mode_from_host(host)
            return mode, (f"could not read node {node_name}'s label {WORKLOAD_LABEL} "
                          f"({type(exc).__name__}: {exc}); {why}")
        if value == "vm-passthrough":
            return Mode.VM_PASSTHROUGH, f"node {node_name} is labeled {WORKLOAD_LABEL}={value}"
        if value == "container":
            return Mode.CONTAINER, f"node {node_name} is labeled {WORKLOAD_LABEL}={value}"
        if value == "vm-vgpu":
            return None, (f"node {node_name} is labeled {WORKLOAD_LABEL}=vm-vgpu, which the "
                          "vGPU device manager serves, not this plugin")
        if value is not None:
            mode, why = mode_from_host(host)
            return mode, (f"node {node_name}'s label {WORKLOAD_LABEL}={value!r} is not one of "
                          f"{', '.join(WORKLOAD_VALUES)}; {why}")
        mode, why = mode_from_host(host)
        return mode, f"node {node_name} has no {WORKLOAD_LABEL} label; {why}"
    mode, why = mode_from_host(host)
    return mode, f"no --node-name or NODE_NAME to read the node label; {why}"


def _build(args: argparse.Namespace) -> tuple[HostRoot, Naming]:
    root = Path(args.host_root)
    if not root.is_dir():
        raise UsageError(f"--host-root {args.host_root!r} is not a directory; pass where the "
                         "host's / is mounted")
    try:
        return HostRoot.at(root), resource_naming.from_arguments(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        host, naming = _build(args)
    except UsageError as exc:
        print(f"sandbox-device-plugin: error: {exc}", file=sys.stderr)
        return 2

    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        log.info("received %s; stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    if args.mode == "auto":
        mode, why = decide_mode(host, args.node_name)
        log.info("mode %s: %s", mode.value if mode else "none", why)
    else:
        mode = Mode(args.mode)
        log.info("mode %s: chosen with --mode", mode.value)
    if mode is None:
        _wait(stop)
        return 0

    manager = PluginManager(host, mode, naming=naming)
    try:
        manager.start()
        _wait(stop)
    except PluginServerError as exc:
        log.error("%s", exc)
        return 1
    finally:
        manager.stop()
    log.info("stopped")
    return 0


def _wait(stop: threading.Event) -> None:
    # Short waits keep the main thread where signal handlers run responsive.
    while not stop.wait(1.0):
        pass


if __name__ == "__main__":
    sys.exit(main())
