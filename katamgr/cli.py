"""The ``katamgr`` command."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from katamgr.errors import ConfigError, KatamgrError
from katamgr.exitcodes import Exit
from katamgr.host import cc
from katamgr.host import selection as device_selection
from katamgr.host.naming import Naming
from katamgr.host.root import STATE_DIR, HostRoot
from katamgr.host.workload import (
    AUTO,
    DEFAULT_WORKLOAD,
    WORKLOADS,
    Operand,
    Workload,
    describe_opt_outs,
    resolve_workload,
)
from katamgr.node import options
from katamgr.node.nvlinkfabric import FabricSettings
from katamgr.node.process import (
    TEXT,
    add_log_format_argument,
    add_version_argument,
    report_error,
    setup_logging,
)
from katamgr.output import documents
from katamgr.output.documents import FORMATS
from katamgr.pipeline.reconcile import DEFAULT_LOCK_WAIT, Steps, full_plan, reconcile, revert_all
from katamgr.pipeline.report import Report
from katamgr.render import plan_text, print_report, quiet, status_text
from nodesim.materialise import materialise
from nodesim.node import open_node, open_root
from nodesim.profiles import find_profile, shipped_names

if TYPE_CHECKING:
    from katamgr.config import KataManagerConfig
    from katamgr.pipeline.kata_runtime import KataContext

log = logging.getLogger("katamgr")

DESCRIPTION = """\
Turn a Kubernetes GPU node into a safe host for Kata Containers with whole GPUs
passed through by VFIO: bind NVIDIA GPUs (with their companion functions) and
NVSwitches to vfio-pci one IOMMU group at a time, and undo it exactly. Which
devices are passed through can be changed with --include-device and
--exclude-device (or the config's devices key); `katamgr plan` says why each
device is in or out.

Start with `katamgr demo` (a simulated DGX-H100-like node, nothing on this
machine is touched), then `katamgr plan --host dgx-h100`.
"""

EPILOG = """\
exit codes:
{exit_codes}
shipped host profiles: {profiles}
"""


def exit_code_table() -> str:
    """The exit codes as --help lists them (docs/operating.md prints the same table)."""
    from katamgr.exitcodes import MEANING

    return "\n".join(f"  {int(code):>3}  {meaning}" for code, meaning in MEANING.items())


def _waits(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wait", type=float, default=DEFAULT_LOCK_WAIT, metavar="SECONDS",
                        help="how long to wait while another katamgr holds the node lock, then fail "
                             f"with nothing changed (default {DEFAULT_LOCK_WAIT:g})")
    parser.add_argument("--device-wait", type=float, default=5.0, metavar="SECONDS",
                        help="how long to wait for /dev/vfio/<group> after binding (default 5)")


def _common(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--host-root", default="/", metavar="DIR",
                       help="where the node's filesystem is mounted (default /; /host in the DaemonSet)")
    where.add_argument("--host", metavar="PROFILE",
                       help="simulate PROFILE (a file or a shipped profile name) in a temp dir and work on that")
    parser.add_argument("--runtime-root", default="/", metavar="DIR", type=runtime_root,
                        help="where the node's / is as containerd sees it, for the device "
                             "nodes CDI specs name (default /; the chart passes "
                             "hostPaths.rootFS)")
    options.add_naming(parser)
    parser.add_argument("--config", metavar="FILE",
                        help="kataManager config (YAML, the GPU Operator's kataManager.config shape); "
                             "with it the Kata chain runs too: artifacts, Kata config, containerd, RuntimeClasses")
    parser.add_argument("--workload", choices=(AUTO, *WORKLOADS), default=AUTO,
                        help="the node's workload (default auto: the node label nvidia.com/gpu.workload.config, "
                             "read through the Kubernetes API when --node-name is known; a node without the "
                             "label runs --default-workload; with no node name or no cluster credentials, "
                             "vm-passthrough. A label value that is not a workload mode exits 2 and a failed "
                             "read exits 1. sandbox-device-plugin --mode auto follows the same rule, falling back "
                             "to what the host shows)")
    parser.add_argument("--default-workload", choices=WORKLOADS, default=DEFAULT_WORKLOAD.value,
                        help="the workload of a node without the label (Helm: sandboxWorkloads.defaultWorkload; "
                             "default container)")
    parser.add_argument("--node-name", metavar="NAME", default=os.environ.get("NODE_NAME"),
                        help="this node's name, for the workload label (default: $NODE_NAME)")
    parser.add_argument("--no-vfio", action="store_true", help="do not bind or unbind devices (vfioManager off)")
    parser.add_argument("--no-cdi", action="store_true", help="do not write CDI specs (cdi off)")
    parser.add_argument("--no-kata", action="store_true", help="skip the Kata chain even with --config (kataManager off)")
    parser.add_argument("--no-runtime-classes", action="store_true",
                        help="leave the cluster's RuntimeClasses to their owner: none is applied, updated or "
                             "deleted (the chart creates them with Helm and passes this)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every step")
    add_log_format_argument(parser)


def _gpu_labels_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-gpu-labels", action="store_true",
                        help="do not publish the GPU labels on the Node (nvidia.com/gpu.product, gpu.family, "
                             "gpu.count, gpu.memory, cc.capable, as GPU Feature Discovery names them, from pci.ids "
                             "and sysfs; Helm: gpuLabels.enabled). Published with a node name and a cluster")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="katamgr", description=DESCRIPTION,
        epilog=EPILOG.format(profiles=", ".join(shipped_names()), exit_codes=exit_code_table()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_version_argument(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("plan", help="show what apply would change (read-only)",
                       description="Show what `katamgr apply` would change on the node. Reads only.")
    _common(p)
    options.add_selection(p)
    options.add_fabric(p)
    _output(p, ("text", "wide", *FORMATS),
            "text (default: the device table fits the terminal, long cells cut with ...), wide (every "
            "column and cell in full), or a versioned json or yaml document (kind Plan)")
    p.add_argument("--no-headers", action="store_true", help="print the device table without its header line")
    p.add_argument("--force", action="store_true", help="plan as if --force were given to apply")
    _gpu_labels_argument(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("apply", help="bind GPUs to vfio-pci and write readiness files",
                       description="Carry out the plan: bind each viable IOMMU group of GPUs/NVSwitches "
                                   "(with companions) to vfio-pci, then write /run/nvidia/validations files. "
                                   "Running it again changes nothing.")
    _common(p)
    options.add_selection(p)
    options.add_fabric(p)
    p.add_argument("--force", action="store_true",
                   help="unbind GPUs even while a process holds /dev/nvidiaN (that workload will crash)")
    _waits(p)
    _output(p, ("text", *FORMATS), "text (default), or a versioned json or yaml document (kind ApplyReport); "
                                   "the progress lines go to stderr either way")
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser("revert", help="put every device back on the driver it had",
                       description="Undo apply: every device katamgr moved goes back to its recorded driver; "
                                   "readiness files are removed. Devices that were on vfio-pci before stay there. "
                                   "What katamgr recorded is reverted whatever the device selection and the "
                                   "config are now (`katamgr status` shows the record): revert takes no "
                                   "--include-device or --exclude-device and needs no --config (a config given "
                                   "adds the paths it names; it never hides what the record lists).")
    _common(p)
    p.add_argument("--force", action="store_true",
                   help="unbind devices even while a process (a Kata VM) holds their /dev/vfio nodes")
    p.add_argument("--delete-runtimeclasses", action="store_true",
                   help="also delete the RuntimeClasses katamgr manages; they serve every node, "
                        "so do this when reverting the last one")
    _waits(p)
    _output(p, ("text", *FORMATS), "text (default), or a versioned json or yaml document (kind RevertReport)")
    p.set_defaults(func=cmd_revert)

    p = sub.add_parser("status", help="show what katamgr installed on the node, from its records (read-only)",
                       description="Show what katamgr installed on this node and where, as its records in "
                                   f"{STATE_DIR} list it: the devices on VFIO and the driver each had, the CDI "
                                   "specs, the Kata runtime class dirs and their artifact refs, the containerd "
                                   "configs edited, the GPU labels set, since when and by which version; and "
                                   "the last apply or revert, with the step an interrupted one reached. "
                                   "Needs no --config: revert undoes exactly what this lists.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--host-root", default="/", metavar="DIR",
                       help="where the node's filesystem is mounted (default /; /host in the DaemonSet)")
    where.add_argument("--host", metavar="PROFILE", help="a fresh simulated node of PROFILE (shows nothing installed)")
    _output(p, ("text", *FORMATS), "text (default), or a versioned json or yaml document (kind Status)")
    p.add_argument("-v", "--verbose", action="store_true")
    add_log_format_argument(p)
    p.set_defaults(func=cmd_status, runtime_root="/")

    p = sub.add_parser("help", help="show the help of a command (katamgr help plan = katamgr plan --help)")
    p.add_argument("topic", nargs="?", metavar="COMMAND", help="the command to explain")
    p.set_defaults(func=None, verbose=False)

    p = sub.add_parser("run", help="the node agent: reconcile, then keep the node that way",
                       description="Reconcile, then watch: re-apply when the containerd config loses our runtimes "
                                   "(someone else's edit or restart), re-pull artifacts every --repull-interval. "
                                   "With --workload auto, a node name and a cluster it follows the Node's workload "
                                   "label and the GPU Operator's opt-out labels (nvidia.com/gpu.deploy.<operand>=false) "
                                   "live, by a watch on the Node: leaving vm-passthrough (or opting out of "
                                   "vfio-manager) gives the free GPUs back to their drivers and keeps those held by "
                                   "VMs (open /dev/vfio nodes) or given to pods (the kubelet's PodResources) until "
                                   "they are free; on a node that no longer runs VMs at start, it gives back what "
                                   "katamgr bound earlier the same way. A failed step is retried with capped "
                                   "exponential backoff (2 s up to 5 min). "
                                   "SIGTERM stops it; the node keeps its state unless --revert-on-exit is given.")
    _common(p)
    options.add_selection(p)
    options.add_fabric(p)
    p.add_argument("--force", action="store_true", help="as for apply")
    _waits(p)
    p.add_argument("--repull-interval", type=float, default=3600.0, metavar="SECONDS",
                   help="how often to check the registry for new artifacts (default 3600)")
    p.add_argument("--revert-on-exit", action="store_true", help="undo everything on SIGTERM/SIGINT")
    p.add_argument("--once", action="store_true", help="reconcile once and exit (like apply)")
    p.add_argument("--plan-only", action="store_true",
                   help="change nothing: work out the plan (as `katamgr plan`) at start and every minute, "
                        "log it when it changes and publish it on /metrics and /readyz; no device is bound, "
                        "no host file, Node label, RuntimeClass or Event written (Helm: kataManager.planOnly)")
    p.add_argument("--metrics-address", metavar="HOST:PORT",
                   help="serve /metrics (Prometheus), /healthz and /readyz there (default: off)")
    p.add_argument("--cc-manager", action="store_true",
                   help="keep the GPUs' confidential-computing mode as the node label nvidia.com/cc.mode asks "
                        "(on, off, devtools, ppcie) with NVIDIA's gpu-admin-tools, and publish "
                        "nvidia.com/cc.mode.state and nvidia.com/cc.ready.state (NVIDIA's k8s-cc-manager's job; "
                        "needs a node name, a cluster and patch on nodes)")
    p.add_argument("--cc-default-mode", choices=cc.MODES, default=cc.DEFAULT_MODE.value,
                   help="with --cc-manager, the mode of a node without the label (default on, as the GPU "
                        "Operator's ccManager.defaultMode; off on a host without SEV-SNP or TDX)")
    _gpu_labels_argument(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("simulate", help="materialise a host profile as a host root",
                       description="Write a simulated node (sysfs shape, /dev/vfio, /proc) for PROFILE into DIR; "
                                   "use it with --host-root DIR. Binding writes there are answered by an emulated kernel.")
    p.add_argument("profile", metavar="PROFILE", help=f"a profile file or one of: {', '.join(shipped_names())}")
    p.add_argument("--into", required=True, metavar="DIR", help="a new or empty directory")
    p.add_argument("--real-device-nodes", action="store_true",
                   help="make /dev/vfio nodes character devices that reach no device, named "
                        "in CDI specs and device plugin answers by their path on this machine, "
                        "so a real container runtime here can inject them (root only; the "
                        "local node of hack/local-cluster)")
    p.add_argument("-v", "--verbose", action="store_true")
    add_log_format_argument(p)
    p.set_defaults(func=cmd_simulate, host=None, host_root=None)

    p = sub.add_parser("demo", help="run the whole job on a simulated DGX-H100-like node",
                       description="Simulate a DGX-H100-like node in a temp dir, plan, apply, apply again, "
                                   "revert, and print a short report. Touches nothing on this machine.")
    p.add_argument("--profile", default="dgx-h100", help="host profile to simulate (default dgx-h100)")
    p.add_argument("--keep", metavar="DIR", help="simulate into DIR and leave it there to look at")
    options.add_selection(p)
    options.add_fabric(p)
    p.add_argument("-v", "--verbose", action="store_true")
    add_log_format_argument(p)
    p.set_defaults(func=cmd_demo, host=None, host_root=None)

    _webhook_parser(sub)
    return parser


def _output(parser: argparse.ArgumentParser, choices: tuple[str, ...], help_text: str) -> None:
    parser.add_argument("-o", "--output", choices=choices, default="text", help=help_text)


def _webhook_parser(sub) -> None:
    from katamgr.admission import DEFAULT_LISTEN, limits, rules

    p = sub.add_parser("webhook", help="the admission webhook: no GPU for a pod that asked for none, "
                                       "passthrough GPUs only in Kata VMs",
                       description="Serve the admission.k8s.io/v1 webhook over HTTPS: POST /mutate sets "
                                   "NVIDIA_VISIBLE_DEVICES=void in every container of a pod that requests no "
                                   "GPU resource; POST /validate denies a pod requesting a passthrough resource "
                                   "unless its runtimeClassName is a Kata class; GET /healthz for probes. The TLS "
                                   "files are read again when they change.")
    p.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                   help=f"address to serve on (default {DEFAULT_LISTEN})")
    p.add_argument("--tls-cert-file", required=True, metavar="FILE", help="PEM server certificate (chain)")
    p.add_argument("--tls-private-key-file", required=True, metavar="FILE", help="PEM private key")
    p.add_argument("--runtime-class", action="append", metavar="NAME",
                   help="a Kata runtime class a passthrough pod may use (repeatable; default "
                        f"{', '.join(rules.DEFAULT_RUNTIME_CLASSES)})")
    p.add_argument("--passthrough-resource", action="append", metavar="PATTERN",
                   help="resources (glob) that are passthrough GPUs, the container GPU names "
                        f"({', '.join(rules.CONTAINER_GPU_RESOURCES)}) excepted (repeatable; default "
                        f"{', '.join(rules.DEFAULT_PASSTHROUGH)})")
    p.add_argument("--confidential-runtime-class", action="append", metavar="NAME",
                   help="a runtime class that runs confidential VMs besides those named *-snp and *-tdx "
                        "(repeatable): /validate refuses it a GPU model with no CC mode")
    p.add_argument("--inject-runtime-class", action="store_true",
                   help="on /mutate, give a passthrough pod without a runtimeClassName the first "
                        "--runtime-class instead of leaving /validate to deny it")
    p.add_argument("--kata-handler", action="append", metavar="PATTERN",
                   help="a RuntimeClass handler (glob) that runs Kata VMs (repeatable; default "
                        f"{', '.join(rules.DEFAULT_KATA_HANDLERS)}); with --check-handlers")
    p.add_argument("--kata-gpu-handler", action="append", metavar="PATTERN",
                   help="a RuntimeClass handler (glob) of a Kata GPU runtime: a class with one takes "
                        "passthrough pods whatever its name (repeatable; default "
                        f"{', '.join(rules.DEFAULT_GPU_HANDLERS)}); judged by the class's name "
                        "without --check-handlers")
    p.add_argument("--check-handlers", action="store_true",
                   help="on /validate, read a passthrough pod's RuntimeClass from the API server (in-cluster "
                        "service account or KUBECONFIG; it needs get on runtimeclasses) and deny it unless its "
                        "handler is a --kata-gpu-handler, or, for a --runtime-class, a --kata-handler")
    limits.add_arguments(p)  # --max-connections, --workers, --request-timeout, --idle-timeout
    p.add_argument("-v", "--verbose", action="store_true", help="log every request")
    add_log_format_argument(p)
    p.set_defaults(func=cmd_webhook, host=None, host_root=None)


@contextlib.contextmanager
def host_from(args: argparse.Namespace) -> Iterator[HostRoot]:
    if getattr(args, "host", None):
        profile = find_profile(args.host)
        with tempfile.TemporaryDirectory(prefix=f"katamgr-{profile.name}-") as tmp:
            log.info("simulating host profile %s in %s", profile.name, tmp)
            yield materialise(profile, Path(tmp) / "host")
        return
    root = Path(args.host_root)
    if not root.is_dir():
        raise ConfigError(f"--host-root {root} is not a directory; pass the path where the node's / is mounted")
    # A dir `katamgr simulate` made gets its emulated kernel back; any other root the real one.
    yield open_root(root, getattr(args, "runtime_root", "/"))


def runtime_root(value: str) -> str:
    """An absolute path (argparse type): it prefixes the host paths CDI specs name."""
    if not value.startswith("/"):
        raise argparse.ArgumentTypeError(f"{value!r} is not an absolute path")
    return value


def config_from(args: argparse.Namespace) -> KataManagerConfig | None:
    """The --config file's model, or None without one (ConfigError when it is bad)."""
    if not args.config:
        return None
    from katamgr.config import load_config  # pydantic: only when a config is given

    return load_config(args.config)


def naming_from(args: argparse.Namespace, config: KataManagerConfig | None = None) -> Naming:
    """The naming options and the device selection: the config's devices, then the flags'."""
    try:
        base = config.devices.selection if config is not None else device_selection.DEFAULT_SELECTION
        return options.naming_from(args, options.selection_from(args, base))
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def with_node_kata(naming: Naming, host: HostRoot, config: KataManagerConfig | None) -> Naming:
    """``naming`` whose selection decides by the Kata release found on the node (its runtimes
    in containerd's config, ``katamgr.host.katadetect``) where none was typed by hand."""
    import dataclasses

    from katamgr.host import katadetect

    containerd, artifacts_dir, names = node_kata_inputs(config)
    return dataclasses.replace(naming, selection=katadetect.node_selection(
        naming.selection, host, containerd, artifacts_dir=artifacts_dir, names=names))


def node_kata_inputs(config: KataManagerConfig | None) -> tuple[str, str, tuple[str, ...]]:
    """Where the node's Kata is found and whose release decides: containerd's config, katamgr's
    artifacts dir and the configured runtime classes."""
    from katamgr import kataclasses
    from katamgr.host import katadetect

    if config is None:
        return katadetect.CONTAINERD_CONFIG, "", kataclasses.DEFAULT_RUNTIME_CLASSES
    return (config.containerd.config_path, config.artifacts_dir,
            tuple(rc.name for rc in config.runtime_classes))


@dataclass(frozen=True)
class NodeSetup:
    """What a command acts with: the steps, the Kata context, the cluster (None: none
    reachable) and why the node runs its workload; the GPU Operator operands the node
    opts out of (``steps.without(opted_out)`` is what apply does; revert undoes all)."""

    steps: Steps
    ctx: KataContext | None
    api: object | None
    workload_why: str
    opted_out: frozenset[Operand] = frozenset()


def steps_and_context(args: argparse.Namespace, host: HostRoot,
                      config: KataManagerConfig | None = None) -> tuple[Steps, KataContext | None]:
    setup = node_setup(args, host, config)
    return setup.steps, setup.ctx


def _by_hand() -> tuple[Workload, str]:
    # Run by hand with no cluster to ask: the operator is here to set the node up.
    return Workload.VM_PASSTHROUGH, "katamgr run by hand sets the node up for it"


def node_setup(args: argparse.Namespace, host: HostRoot, config: KataManagerConfig | None = None) -> NodeSetup:
    """``config``: the --config file already loaded (else it is loaded here)."""
    if config is None:
        config = config_from(args)
    wants_cluster = (config is not None and not args.no_kata) or (args.workload == AUTO and args.node_name)
    if wants_cluster or config is not None:
        from katamgr import cluster  # the Kubernetes client costs a second: only when it is used
        from katamgr.node.apiclient import connect
    # A simulated node talks to a cluster only when one is named (KUBECONFIG or the
    # pod's service account, as the chart's DaemonSets on a simulated node do).
    api = connect(home_kubeconfig=open_node(host.root) is None) if wants_cluster else None
    if args.workload == AUTO:
        def read_labels(node: str):
            from katamgr.node.kube import read_node_labels  # the Kubernetes client: only to ask

            return read_node_labels(api, node)

        resolved = resolve_workload(
            args.node_name,
            read_labels if api is not None else None,
            default=args.default_workload,
            fallback=_by_hand,
        )
        opted_out = resolved.opted_out
        workload, why = resolved.workload, resolved.why
        if opted_out:
            why += f"; it opts out of {describe_opt_outs(opted_out)}"
        log.info("node workload %s: %s", workload, why)
    else:
        workload, why, opted_out = Workload(args.workload), "chosen with --workload", frozenset()
    steps = Steps(vfio=not args.no_vfio, cdi=not args.no_cdi, kata=not args.no_kata, workload=workload)
    ctx = None
    if config is not None:
        from katamgr.pipeline.kata_runtime import KataContext

        ctx = KataContext(config, api, cluster.agent_namespace(),
                          manage_runtime_classes=not args.no_runtime_classes)
    return NodeSetup(steps, ctx, api, why, opted_out)


def fabric_settings(args: argparse.Namespace, host: HostRoot, config: KataManagerConfig | None) -> FabricSettings:
    """The NVLink fabric settings: the config's (defaults without one), then the flags'; on a
    simulated node whose Fabric Manager runs, where FM and its library are unless told."""
    settings = FabricSettings()
    if config is not None:
        fm = config.devices.fabric_manager
        settings = FabricSettings(config.devices.nvlink_fabric, fm.address, fm.library, fm.gpu_module_ids)
    try:
        settings = options.fabric_from(args, settings)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    node = open_node(host.root)
    simulated = node.fabric_manager() if node is not None else None
    if simulated is not None and (settings.address, settings.library) == (FabricSettings.address,
                                                                         FabricSettings.library):
        library, socket, modules = simulated
        settings = replace(settings, address=socket, library=library,
                           gpu_module_ids=settings.gpu_module_ids or modules)
    return settings


def cmd_plan(args: argparse.Namespace) -> int:
    config = config_from(args)
    naming = naming_from(args, config)
    with host_from(args) as host:
        naming = with_node_kata(naming, host, config)
        setup = node_setup(args, host, config)
        plan = full_plan(host, naming, setup.steps.without(setup.opted_out), setup.ctx, force=args.force,
                         workload_why=setup.workload_why, gpu_labels=not args.no_gpu_labels,
                         fabric=fabric_settings(args, host, config))
        if args.output in FORMATS:
            print(documents.dump(documents.plan_document(plan), args.output))
        else:
            print(plan_text(plan, wide=args.output == "wide", headers=not args.no_headers))
    return Exit.PROBLEMS if plan.problems else Exit.OK


def cmd_apply(args: argparse.Namespace) -> int:
    config = config_from(args)
    naming = naming_from(args, config)
    with host_from(args) as host:
        naming = with_node_kata(naming, host, config)
        setup = node_setup(args, host, config)
        steps = setup.steps.without(setup.opted_out)
        report = reconcile(host, naming, steps, setup.ctx, force=args.force,
                           wait=args.device_wait,
                           lock_wait=args.wait, command="katamgr apply", journal=_journal(host, "katamgr apply"))
        report.merge(_offer(setup, steps, args, report))
        # "Nothing to change" only where nothing was left out either.
        _show_report(args, "ApplyReport", report,
                     "" if report.problems else "nothing to change: the node is already as planned")
        _tell_how_to_undo(report, args)
    return report.exit_code()


def _offer(setup: NodeSetup, steps: Steps, args: argparse.Namespace, report: Report) -> Report:
    """The runtime classes this node offers, on its Node (``pipeline.offers``), where a node name
    and a cluster are known; without them, say which label the classes need."""
    if setup.ctx is None or report.classes_ready is None:
        return Report()
    from katamgr.kataclasses import offer_label
    from katamgr.pipeline import offers

    configured = [rc.name for rc in setup.ctx.config.runtime_classes]
    if setup.api is None or not args.node_name:
        labels = ", ".join(f"{offer_label(n)}=true" for n in report.classes_ready)
        return Report(warnings=[f"the RuntimeClasses run only on nodes labeled {labels or 'for them'}; pass "
                                "--node-name (or NODE_NAME) with a cluster and katamgr labels this node"]
                      if report.classes_ready else [])
    ready = report.classes_ready if steps.passthrough and steps.kata else []
    return offers.publish(_node_labels(setup.api, args.node_name), offers.wanted(configured, ready))


def _journal(host: HostRoot, command: str):
    """The run journal of an apply or revert: recorded on the node, each step said on stderr."""
    from katamgr.node.journal import Journal
    from katamgr.output.progress import progress_printer

    return Journal(host, command, progress_printer(command))


def _show_report(args: argparse.Namespace, kind: str, report: Report, nothing: str) -> None:
    if args.output in FORMATS:
        summary = nothing if quiet(report) else ""
        print(documents.dump(documents.report_document(kind, report, summary), args.output))
    else:
        print_report(report, nothing)


def _tell_how_to_undo(report: Report, args: argparse.Namespace) -> None:
    """A failed apply that changed something says so, and how to undo it (exit 1); a partly
    done one names the runtime classes that are not offered (exit 3)."""
    where = f" --host-root {args.host_root}" if args.host_root not in (None, "/") else ""
    if report.partly:
        print(f"katamgr: partly done: runtime class(es) {', '.join(sorted(report.classes_failed))} failed and "
              "are not offered on this node; the rest is in place (`katamgr run` retries them, or run apply "
              "again once the cause is fixed)", file=sys.stderr)
        return
    if not report.failures or not report.changes:
        return
    print(f"katamgr: apply failed after the changes listed above, which are still in place; "
          f"`katamgr revert{where}` undoes them (it follows the node's record: no --config needed)",
          file=sys.stderr)


def cmd_revert(args: argparse.Namespace) -> int:
    if args.delete_runtimeclasses and args.no_runtime_classes:
        raise ConfigError("--delete-runtimeclasses and --no-runtime-classes contradict each other: "
                          "RuntimeClasses left to the chart are deleted by helm uninstall")
    with host_from(args) as host:
        steps, ctx = steps_and_context(args, host)
        report = revert_all(host, steps, ctx, force=args.force,
                            delete_runtime_classes=args.delete_runtimeclasses, lock_wait=args.wait,
                            node_labels=_revert_node_labels(args, host, ctx),
                            journal=_journal(host, "katamgr revert"))
        if steps.kata and ctx is not None and ctx.api is not None and args.node_name:
            from katamgr.pipeline import offers

            report.merge(offers.withdraw(_node_labels(ctx.api, args.node_name)))
        _show_report(args, "RevertReport", report, "nothing to revert: katamgr has no changes recorded on this node")
    return 0 if report.ok else 1


def cmd_status(args: argparse.Namespace) -> int:
    from katamgr.pipeline.status import node_status

    with host_from(args) as host:
        status = node_status(host)
    if args.output in FORMATS:
        summary = "" if status.installed else "nothing installed: katamgr has no changes recorded on this node"
        print(documents.dump(documents.status_document(status, summary), args.output))
    else:
        print(status_text(status))
    return 0


def _node_labels(api: object, node_name: str, watch=None):
    """Our Node's labels for the GPU labels: read (from the watch when there is one) and patched."""
    from katamgr.cluster import set_node_labels
    from katamgr.node.kube import read_node_labels
    from katamgr.pipeline.gpulabels import NodeLabels

    def fresh():
        return read_node_labels(api, node_name)

    return NodeLabels(watch.labels if watch is not None else fresh,
                      lambda labels: set_node_labels(api, node_name, labels),
                      fresh if watch is not None else None)


def _revert_node_labels(args: argparse.Namespace, host: HostRoot, ctx: KataContext | None):
    """The Node's labels to remove the GPU labels katamgr set from: only asked for when it set some."""
    from katamgr.host import gpulabels

    if not args.node_name or not gpulabels.recorded(host):
        return None
    api = ctx.api if ctx is not None and ctx.api is not None else None
    if api is None:
        from katamgr.node.apiclient import connect

        api = connect(home_kubeconfig=open_node(host.root) is None)
    return _node_labels(api, args.node_name) if api is not None else None


def cmd_run(args: argparse.Namespace) -> int:
    from katamgr.agent import Agent
    from katamgr.agent.katafound import KataFound

    # A daemon's log is its only voice: say what changed even without -v.
    logging.getLogger().setLevel(logging.INFO)
    if args.plan_only and (args.revert_on_exit or args.cc_manager):
        raise ConfigError(f"--plan-only changes nothing, so it cannot be given with "
                          f"{'--revert-on-exit' if args.revert_on_exit else '--cc-manager'}")
    config = config_from(args)
    naming = naming_from(args, config)
    if args.metrics_address:
        from katamgr.node.metrics_server import parse_address

        try:
            parse_address(args.metrics_address)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    with host_from(args) as host:
        given = naming
        naming = with_node_kata(naming, host, config)
        setup = node_setup(args, host, config)
        if args.plan_only:
            return _run_plan_only(args, host, naming, setup)
        events = None
        if setup.api is not None and args.node_name:
            from katamgr.cluster import EventRecorder

            # In "default", the one namespace the API server accepts a Node's Events in
            # (the chart's <release>-node-events Role there lets the agent create them).
            events = EventRecorder(setup.api, args.node_name)
        from katamgr.agent.following import node_follower

        follower = None if args.once else node_follower(
            setup.api, args.node_name, workload=args.workload,
            default_workload=args.default_workload, fallback=_by_hand)
        agent = Agent(host, naming, setup.steps, setup.ctx, force=args.force, wait=args.device_wait,
                      lock_wait=args.wait,
                      repull_interval=args.repull_interval, revert_on_exit=args.revert_on_exit,
                      events=events, metrics_address=args.metrics_address,
                      read_workload=follower.read if follower else None,
                      node_watch=follower.watch.start() if follower else None, opted_out=setup.opted_out,
                      fabric=fabric_settings(args, host, config),
                      node_labels=None if args.no_gpu_labels or setup.api is None or not args.node_name
                      else _node_labels(setup.api, args.node_name, follower.watch if follower else None),
                      offer_labels=None if setup.api is None or not args.node_name or setup.ctx is None
                      else _node_labels(setup.api, args.node_name, follower.watch if follower else None),
                      kata_found=KataFound(given.selection, *node_kata_inputs(config)),
                      **_cc_options(args, setup.api, follower.watch if follower else None))
        return agent.run(once=args.once)


def _run_plan_only(args: argparse.Namespace, host: HostRoot, naming: Naming, setup: NodeSetup) -> int:
    """``katamgr run --plan-only``: the plan, kept up to date and published, never carried out.
    The Node's labels are only read (by the watch when it follows them)."""
    from katamgr.agent.following import node_follower
    from katamgr.agent.planonly import PlanOnlyAgent

    follower = None if args.once else node_follower(
        setup.api, args.node_name, workload=args.workload,
        default_workload=args.default_workload, fallback=_by_hand)
    watch = follower.watch.start() if follower else None

    def make_plan():
        steps, out, why = setup.steps, setup.opted_out, setup.workload_why
        if follower is not None:
            resolved = follower.read()
            steps, out, why = replace(steps, workload=resolved.workload), resolved.opted_out, resolved.why
        return full_plan(host, naming, steps.without(out), setup.ctx, force=args.force, workload_why=why,
                         gpu_labels=not args.no_gpu_labels)

    try:
        return PlanOnlyAgent(make_plan, metrics_address=args.metrics_address).run(once=args.once)
    finally:
        if watch is not None:
            watch.stop()


def _cc_options(args: argparse.Namespace, api: object | None, watch) -> dict:
    """What the agent's CC room needs: the default mode (None: off), the labels, a labeller."""
    if not args.cc_manager:
        return {}
    if api is None or not args.node_name:
        raise ConfigError("--cc-manager follows the node label nvidia.com/cc.mode: it needs --node-name "
                          "(or NODE_NAME) and a cluster to ask")
    from katamgr.cluster import node_resources, set_node_labels
    from katamgr.node.kube import read_node_labels

    read = watch.labels if watch is not None else (lambda: read_node_labels(api, args.node_name))
    return {"cc_default_mode": cc.CcMode(args.cc_default_mode), "read_labels": read,
            "publish_labels": lambda labels: set_node_labels(api, args.node_name, labels),
            "read_resources": lambda: node_resources(api, args.node_name)}


def cmd_simulate(args: argparse.Namespace) -> int:
    profile = find_profile(args.profile)
    host = materialise(profile, args.into, real_device_nodes=args.real_device_nodes)
    print(f"simulated {profile.name} ({len(profile.devices)} PCI devices) in {host.root}")
    print(f"try: katamgr plan --host-root {host.root}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from katamgr.demo import run_demo

    if not args.verbose:
        # The demo tells its own story; library warnings would repeat it.
        logging.getLogger().setLevel(logging.ERROR)
    return run_demo(args)


def cmd_webhook(args: argparse.Namespace) -> int:
    from katamgr.admission.limits import from_args
    from katamgr.admission.rules import (
        DEFAULT_GPU_HANDLERS,
        DEFAULT_KATA_HANDLERS,
        DEFAULT_PASSTHROUGH,
        DEFAULT_RUNTIME_CLASSES,
        Policy,
    )
    from katamgr.admission.server import make_server

    logging.getLogger().setLevel(logging.DEBUG if args.verbose else logging.INFO)
    policy = Policy(runtime_classes=tuple(args.runtime_class or DEFAULT_RUNTIME_CLASSES),
                    passthrough=tuple(args.passthrough_resource or DEFAULT_PASSTHROUGH),
                    inject_runtime_class=args.inject_runtime_class,
                    confidential_classes=tuple(args.confidential_runtime_class or ()),
                    kata_handlers=tuple(args.kata_handler or DEFAULT_KATA_HANDLERS),
                    gpu_handlers=tuple(args.kata_gpu_handler or DEFAULT_GPU_HANDLERS),
                    handler_of=_handler_lookup() if args.check_handlers else None)
    server = make_server(args.listen, args.tls_cert_file, args.tls_private_key_file, policy,
                         from_args(args))
    log.warning("katamgr webhook serving on https://%s (runtime classes %s)", args.listen,
                ", ".join(policy.runtime_classes))
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


def _handler_lookup():
    from katamgr.cluster.handlers import handler_lookup
    from katamgr.node.apiclient import connect

    api = connect(home_kubeconfig=False)
    if api is None:
        raise ConfigError("--check-handlers reads RuntimeClasses from the API server, but there is no "
                          "in-cluster service account and no KUBECONFIG")
    return handler_lookup(api)


def exit_code_of(exc: BaseException) -> int | None:
    """The exit code of an error raised on purpose, whose message says it all (2: bad usage
    or configuration, nothing was changed; 1: a failure); None for anything else (a bug)."""
    if isinstance(exc, FileExistsError):  # a non-empty --into
        return ConfigError.exit_code
    if isinstance(exc, KatamgrError):  # HostError and ProfileError included
        return exc.exit_code
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "help":
        # `katamgr help plan` is `katamgr plan --help`; `katamgr help` is `katamgr --help`.
        parser.parse_args([args.topic, "--help"] if args.topic else ["--help"])
    log_format = getattr(args, "log_format", TEXT)
    setup_logging(logging.INFO if args.verbose else logging.WARNING, log_format)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - every error ends here: one sentence and an exit code
        code = exit_code_of(exc)
        if code is not None:
            report_error(f"katamgr: {exc}", log_format, log)
            return code
        report_error(f"katamgr: unexpected {type(exc).__name__}: {exc} (run with -v for the traceback; "
                     f"please report it)", log_format, log, exc_info=getattr(args, "verbose", False))
        return 1


if __name__ == "__main__":
    sys.exit(main())
