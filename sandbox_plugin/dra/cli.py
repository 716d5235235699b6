"""``sandbox-dra-driver``: the node's passthrough units through Dynamic Resource Allocation."""

from __future__ import annotations

import argparse
import logging
import sys
import threading

from gpunode.errors import GpuNodeError
from gpunode.k8snames import is_dns1123_subdomain
from gpunode.kataclasses import KATA_GPU_HANDLERS, KATA_HANDLERS, PASSTHROUGH_RUNTIME_CLASSES
from gpunode.policy.workload import NoCluster, Workload
from gpunode.services import options
from gpunode.services.process import (
    report_error,
    setup_logging,
    stop_on_signals,
)
from sandbox_plugin.commands import UsageError, cluster_client, mode_from_host, node_context
from sandbox_plugin.follow import mode_for
from sandbox_plugin.manager import Mode

log = logging.getLogger("sandbox_plugin.dra")

DEFAULT_DRIVER = "passthrough.kata-sandbox-manager.io"

DRIVER_NAME_MAX = 63  # a DRA driver name is validated as a CSI driver name

DESCRIPTION = f"""\
Publish a node's passthrough GPUs, NVSwitches and included devices (each IOMMU
group bound to vfio-pci: one device) as a ResourceSlice of DRA driver
--driver-name (default {DEFAULT_DRIVER}), and prepare the claims the kubelet hands
it with the CDI names of katamgr's specs (<resource name>=<PCI address>).

The kubelet finds it by <kubelet-dir>/plugins_registry/<driver>-reg.sock and calls
<kubelet-dir>/plugins/<driver>/dra.sock; prepared claims are kept in
checkpoint.json beside it. Devices are found as sandbox-device-plugin finds them
(the same --include-device/--exclude-device and naming options; give both
programs, and katamgr, the same), and a change (bind, unbind, health) is published
within a second. The slice is offered while the node's label
nvidia.com/gpu.workload.config asks for vm-passthrough (or, unlabeled,
--default-workload does: default container; --workload fixes it instead) and the node does not opt
out of the sandbox device plugin (nvidia.com/gpu.deploy.sandbox-device-plugin=false);
otherwise it is deleted, and put back when the label asks again.

A claim is prepared only while every pod it is reserved for runs in a Kata GPU
runtime class, judged by the class's handler on every prepare (a claim prepared
before included): a handler of a Kata GPU runtime ({", ".join(KATA_GPU_HANDLERS)}),
(--kata-gpu-handler), or a class named by --kata-runtime-class (default
{", ".join(PASSTHROUGH_RUNTIME_CLASSES)}) with a Kata handler ({", ".join(KATA_HANDLERS)};
--kata-handler), as the admission layers judge it. A runc container given the CDI
names would get the raw VFIO device. --any-runtime-class turns the check off.

Needs the Kubernetes API (in-cluster, else a kubeconfig): get on resourceclaims,
pods and runtimeclasses, list/create/update/delete on resourceslices, get/watch on
its node.
Stops cleanly (sockets removed, exit 0) on SIGTERM or SIGINT.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sandbox-dra-driver", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_version(parser)
    options.add_node_options(parser)  # as katamgr and the device plugin take them
    parser.add_argument("--driver-name", default=DEFAULT_DRIVER, metavar="NAME",
                        help=f"the DRA driver name, a DNS subdomain of at most {DRIVER_NAME_MAX} "
                             f"characters (default: {DEFAULT_DRIVER})")
    parser.add_argument("--kata-runtime-class", action="append", default=[], metavar="NAME",
                        help="a runtime class whose pods may be prepared claims of this driver "
                             "while its handler is a Kata runtime's (repeatable; default: "
                             f"{', '.join(PASSTHROUGH_RUNTIME_CLASSES)})")
    parser.add_argument("--kata-handler", action="append", default=[], metavar="PATTERN",
                        help="a RuntimeClass handler (glob) of a Kata runtime: a --kata-runtime-class "
                             f"must have one (repeatable; default: {', '.join(KATA_HANDLERS)})")
    parser.add_argument("--kata-gpu-handler", action="append", default=[], metavar="PATTERN",
                        help="a RuntimeClass handler (glob) of a Kata GPU runtime: a class with one takes "
                             f"claims whatever its name (repeatable; default: {', '.join(KATA_GPU_HANDLERS)})")
    parser.add_argument("--any-runtime-class", action="store_true",
                        help="prepare claims for pods of any runtime class (a runc pod then gets "
                             "the raw VFIO device)")
    options.add_containerd_config(parser)
    options.add_verbose(parser, "log debug details")
    return parser


def check_driver_name(name: str) -> str:
    if len(name) > DRIVER_NAME_MAX or not is_dns1123_subdomain(name.lower()) or name != name.lower():
        raise UsageError(
            f"--driver-name {name!r} is not a DRA driver name: use a lower-case DNS subdomain of at "
            f"most {DRIVER_NAME_MAX} characters, such as {DEFAULT_DRIVER!r}")
    return name


def runtime_classes_from(args: argparse.Namespace) -> frozenset[str] | None:
    if args.any_runtime_class:
        if args.kata_runtime_class:
            raise UsageError("--any-runtime-class and --kata-runtime-class contradict each other; give one")
        return None
    names = frozenset(args.kata_runtime_class or PASSTHROUGH_RUNTIME_CLASSES)
    for name in sorted(names):
        if not is_dns1123_subdomain(name):
            raise UsageError(f"--kata-runtime-class {name!r} is not a RuntimeClass name (a DNS subdomain)")
    return names


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(logging.DEBUG if args.verbose else logging.INFO, args.log_format)
    stop = threading.Event()
    driver = watch = None
    try:
        if not args.node_name:
            raise UsageError("no node name: pass --node-name or set NODE_NAME (the pool and the "
                             "slice's spec.nodeName are the node's)")
        check_driver_name(args.driver_name)
        runtime_classes = runtime_classes_from(args)
        node = node_context(args)
        host, naming, extras = node.host, node.naming, node.extras
        from gpunode.policy.inventory import discover
        from sandbox_plugin.fabric import DRA_RECORD, FabricGuard
        from sandbox_plugin.fabricgate import gate_for

        # Where neither of NVIDIA's models holds, the board's GPUs stay out of the slice; in the
        # Shared NVSwitch model the NVSwitches stay with FM, unpublished (the context's naming).
        # Its own record, released at NodeUnprepareResources (not by PodResources).
        gate = gate_for(host, node.fabric, discover(host, naming.selection, naming.nvswitch_rule), lambda: FabricGuard(
            host, node.fabric, given=lambda: None, record=DRA_RECORD), choice=node.fabric_choice)
        try:
            api = cluster_client(extras)
        except NoCluster as exc:
            raise GpuNodeError(f"no Kubernetes API to read claims from and publish to ({exc}); run "
                               "in a pod with a service account, or set KUBECONFIG") from None
        from gpunode.services.kube import NodeLabelWatch
        from sandbox_plugin.dra.driver import DraDriver

        watch = NodeLabelWatch(api, args.node_name).start()

        def decide() -> None:
            def from_host() -> tuple[Workload, str]:
                mode, why = mode_from_host(host, naming.selection, naming.nvswitch_rule)
                return Workload(mode.value), why

            # As the device plugin: a fixed --workload does not ask the node's labels.
            resolved = node.workload.resolve(lambda _node: watch.labels(), from_host)
            mode, why = mode_for(resolved, frozenset({Mode.VM_PASSTHROUGH}))
            driver.publishing(mode is not None, why)

        driver = DraDriver(host, naming, api, driver=args.driver_name, node=args.node_name,
                           kubelet_dir=args.kubelet_dir, runtime_classes=runtime_classes, fabric=gate,
                           handlers=(tuple(args.kata_handler or KATA_HANDLERS),
                                     tuple(args.kata_gpu_handler or KATA_GPU_HANDLERS)),
                           link_policy=node.link_policy)
        decide()  # at start a bad label or an unreadable Node is an error, as for the plugin
        stop_on_signals(stop.set, log)
        changed = threading.Event()
        watch.on_change = changed.set
        driver.start()
    except GpuNodeError as exc:  # bad usage 2, the API or the checkpoint failing 1
        if watch is not None:
            watch.stop()
        report_error(f"sandbox-dra-driver: error: {exc}", args.log_format, log)
        return exc.exit_code
    try:
        while not stop.wait(0.2):
            if changed.is_set():
                changed.clear()
                try:
                    decide()
                except GpuNodeError as exc:  # keep what runs; the watch tells us when it reads again
                    log.warning("could not read the node's workload (%s); keeping the slice as it is", exc)
    finally:
        driver.stop()
        watch.stop()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
