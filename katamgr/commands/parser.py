"""The ``katamgr`` command line: its subcommands, their flags and --help text."""

from __future__ import annotations

import argparse

from gpunode.errors import ConfigError
from gpunode.host import cc
from gpunode.host.root import STATE_DIR
from gpunode.services import options, simulator
from katamgr.commands.change import cmd_apply, cmd_plan, cmd_revert, cmd_status
from katamgr.commands.fleet import cmd_fleet
from katamgr.commands.run import cmd_run
from katamgr.commands.simulated import cmd_demo, cmd_simulate
from katamgr.commands.webhook import cmd_webhook
from katamgr.output.documents import FORMATS
from katamgr.pipeline.reconcile import DEFAULT_LOCK_WAIT

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
    options.add_host_root(where)
    where.add_argument("--host", metavar="PROFILE",
                       help="simulate PROFILE (a file or a shipped profile name) in a temp dir and work on that")
    options.add_runtime_root(parser)
    options.add_kubelet_dir(parser)
    options.add_naming(parser)
    parser.add_argument("--config", metavar="FILE",
                        help="kataManager config (YAML, the GPU Operator's kataManager.config shape); "
                             "with it the Kata chain runs too: artifacts, Kata config, containerd, RuntimeClasses")
    options.add_node(parser)  # --node-name, --workload, --default-workload: as the plugins take them
    parser.add_argument("--no-vfio", action="store_true", help="do not bind or unbind devices (vfioManager off)")
    parser.add_argument("--no-cdi", action="store_true", help="do not write CDI specs (cdi off)")
    parser.add_argument("--no-kata", action="store_true", help="skip the Kata chain even with --config (kataManager off)")
    parser.add_argument("--no-runtime-classes", action="store_true",
                        help="leave the cluster's RuntimeClasses to their owner: none is applied, updated or "
                             "deleted (the chart creates them with Helm and passes this)")
    options.add_verbose(parser)
    options.add_log_format(parser)


def _gpu_labels_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-gpu-labels", action="store_true",
                        help="do not publish the GPU labels on the Node (nvidia.com/gpu.product, gpu.family, "
                             "gpu.count, gpu.memory, cc.capable, as GPU Feature Discovery names them, from pci.ids "
                             "and sysfs; Helm: gpuLabels.enabled). Published with a node name and a cluster")


def _profile_names() -> str:
    """The shipped host profiles, as --help lists them (none without the simulated node)."""
    try:
        sim = simulator.installed()
    except ConfigError:  # a broken KATAMGR_SIMULATOR: the command that needs it says so
        return "none (the simulated node cannot be loaded)"
    return ", ".join(sim.profile_names()) if sim is not None else "none (the simulated node is not installed)"


class _TopParser(argparse.ArgumentParser):
    """katamgr's parser, whose help lists the shipped profiles: asked for only when the help
    is shown, since finding the simulated node scans the installed packages' metadata."""

    def format_help(self) -> str:
        self.epilog = EPILOG.format(profiles=_profile_names(), exit_codes=exit_code_table())
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    parser = _TopParser(prog="katamgr", description=DESCRIPTION,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("plan", help="show what apply would change (read-only)",
                       description="Show what `katamgr apply` would change on the node. Reads only.")
    _common(p)
    options.add_selection(p)
    options.add_fabric(p)
    options.add_health(p)
    _output(p, ("text", "wide", *FORMATS),
            "text (default: the device table fits the terminal, long cells cut with ...), wide (every "
            "column and cell in full), or a versioned json or yaml document (kind Plan)")
    p.add_argument("--no-headers", action="store_true", help="print the device table without its header line")
    p.add_argument("--force", action="store_true", help="plan as if --force were given to apply")
    p.add_argument("--split", metavar="VALUE",
                   help="plan the node split between VMs and containers as the label "
                        "nvidia.com/gpu.workload.vm-passthrough.gpus=VALUE would (2, all, index.6_7, "
                        "pci.c1-00.0, model.2330; default: the node's label with --node-name) and show what "
                        "the change would move")
    _gpu_labels_argument(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("apply", help="bind GPUs to vfio-pci and write readiness files",
                       description="Carry out the plan: bind each viable IOMMU group of GPUs/NVSwitches "
                                   "(with companions) to vfio-pci, then write /run/nvidia/validations files. "
                                   "Running it again changes nothing.")
    _common(p)
    options.add_selection(p)
    options.add_fabric(p)
    options.add_health(p)
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
    options.add_host_root(where)
    where.add_argument("--host", metavar="PROFILE", help="a fresh simulated node of PROFILE (shows nothing installed)")
    _output(p, ("text", *FORMATS), "text (default), or a versioned json or yaml document (kind Status)")
    p.add_argument("-v", "--verbose", action="store_true")
    options.add_log_format(p)
    p.set_defaults(func=cmd_status, runtime_root="/")

    p = sub.add_parser("fleet", help="every node's state from the API: workload, Kata, classes, conditions (read-only)",
                       description="List every Node (or those -l selects) as the API holds it, with your "
                                   "kubeconfig: its workload label, the Kata release found there, the runtime "
                                   "classes offered there (runtimeclass.kata-sandbox-manager.io/<class>=true), "
                                   "the agent's Node conditions (Sandbox*; those not True named with their "
                                   "reason), the GPUs the kubelet counts but does not offer (unhealthy) and "
                                   "the last transition of our conditions. Writes nothing.")
    p.add_argument("-l", "--selector", metavar="SELECTOR", help="a label selector, as kubectl's (e.g. "
                   "nvidia.com/gpu.workload.config=vm-passthrough)")
    _output(p, ("text", *FORMATS), "text (default), or a versioned json or yaml document (kind Fleet)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=cmd_fleet)

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
    options.add_health(p)
    p.add_argument("--force", action="store_true", help="as for apply")
    _waits(p)
    p.add_argument("--repull-interval", type=float, default=3600.0, metavar="SECONDS",
                   help="how often to check the registry for new artifacts (default 3600)")
    p.add_argument("--revert-on-exit", action="store_true", help="undo everything on SIGTERM/SIGINT")
    p.add_argument("--offer-gate", action="store_true",
                   help="offer the runtime classes on the Node (runtimeclass.kata-sandbox-manager.io/<class>=true) "
                        "only while the kubelet's PodResources lists the device plugin's devices as allocatable, "
                        "and on SIGTERM take them off first and wait (at most 10 s) for the kubelet to take the "
                        "pods bound before, so no pod is refused admission in the plugin's gap (the chart sets it "
                        "where the device plugin runs beside the agent)")
    p.add_argument("--rejected-pods", choices=("none", "event"), default="none",
                   help="event: each time the offer gate opens (and every 5 s for a minute while it stays "
                        "open), list the node's Failed pods and name, in a "
                        "Warning Event on the Node (PodRefusedAtAdmission), each one the kubelet refused "
                        "(UnexpectedAdmissionError) for a passthrough resource of this node before the device "
                        "plugin registered, as after a node reboot; needs --offer-gate, --node-name and the "
                        "right to list pods (the chart's sandboxDevicePlugin.rejectedPods). Default none")
    p.add_argument("--once", action="store_true", help="reconcile once and exit (like apply)")
    p.add_argument("--plan-only", action="store_true",
                   help="change nothing: work out the plan (as `katamgr plan`) at start and every minute, "
                        "log it when it changes and publish it on /metrics and /readyz; no device is bound, "
                        "no host file, Node label, RuntimeClass or Event written (Helm: kataManager.planOnly)")
    options.add_metrics_address(p)
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
    p.add_argument("profile", metavar="PROFILE", help="a profile file or the name of a shipped one (`katamgr --help` lists them)")
    p.add_argument("--into", required=True, metavar="DIR", help="a new or empty directory")
    p.add_argument("--real-device-nodes", action="store_true",
                   help="make /dev/vfio nodes character devices that reach no device, named "
                        "in CDI specs and device plugin answers by their path on this machine, "
                        "so a real container runtime here can inject them (root only; the "
                        "local node of hack/local-cluster)")
    p.add_argument("-v", "--verbose", action="store_true")
    options.add_log_format(p)
    p.set_defaults(func=cmd_simulate, host=None, host_root=None)

    p = sub.add_parser("demo", help="run the whole job on a simulated DGX-H100-like node",
                       description="Simulate a DGX-H100-like node in a temp dir, plan, apply, apply again, "
                                   "revert, and print a short report. Touches nothing on this machine.")
    p.add_argument("--profile", default="dgx-h100", help="host profile to simulate (default dgx-h100)")
    p.add_argument("--keep", metavar="DIR", help="simulate into DIR and leave it there to look at")
    options.add_selection(p)
    options.add_fabric(p)
    p.add_argument("-v", "--verbose", action="store_true")
    options.add_log_format(p)
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
    p.add_argument("--dra-driver", metavar="NAME",
                   help="the DRA driver of passthrough GPUs (sandbox-dra-driver's --driver-name): on /validate, "
                        "read the ResourceClaims and ResourceClaimTemplates a pod names and deny it outside a "
                        "Kata GPU class when one requests them, and deny adding a pod outside one to the "
                        "status.reservedFor of a claim holding them (it needs get on resourceclaims, "
                        "resourceclaimtemplates and pods)")
    p.add_argument("--dra-device-class", action="append", metavar="NAME",
                   help="a DeviceClass of that driver's passthrough devices (repeatable; default "
                        "gpu.<driver> and nvswitch.<driver>, the chart's)")
    limits.add_arguments(p)  # --max-connections, --workers, --request-timeout, --idle-timeout
    # The nodes' kubelet root dir: its pod-resources, plugins and plugins_registry dirs are
    # control points no pod's hostPath may reach.
    options.add_kubelet_dir(p)
    p.add_argument("-v", "--verbose", action="store_true", help="log every request")
    options.add_log_format(p)
    p.set_defaults(func=cmd_webhook, host=None, host_root=None)
