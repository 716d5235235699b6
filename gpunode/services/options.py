"""The command-line options of the three node programs, declared once.

``katamgr``, ``sandbox-device-plugin`` and ``sandbox-dra-driver`` run side by side on a node
and must agree: on where the host is (``--host-root``, ``--runtime-root``), which node they
are (``--node-name``), what it runs (``--workload``, ``--default-workload``), which devices
are passthrough devices and what they are called (the selection and naming options), and
the NVLink fabric's model. Each setting has one spelling, one default and one check here,
and each program builds its parser from these functions (as NVIDIA's k8s-device-plugin
builds both of its binaries' flags from one config type). Where a setting also has a chart
value or a config key, the option takes the value's own spelling (``--nvswitches true``,
``--runtime-root`` as ``hostPaths.rootFS`` is written), so the chart passes values through.

The host and node modules stay free of the command line: they take the dataclasses the
``*_from`` functions build (``Selection``, ``Naming``, ``FabricSettings``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path, PurePosixPath

from gpunode.errors import ConfigError
from gpunode.host.pciids import PciIds
from gpunode.host.root import KUBELET_DIR
from gpunode.policy import health, katadetect
from gpunode.policy import naming as names
from gpunode.policy import selection as sel
from gpunode.policy.katarelease import UNKNOWN, KataRelease, parse_release
from gpunode.policy.workload import AUTO, DEFAULT_WORKLOAD, WORKLOADS
from gpunode.services import nvlinkfabric as nf
from gpunode.services.fabricmanager import DEFAULT_ADDRESS, DEFAULT_LIBRARY
from gpunode.services.process import DISTRIBUTION, LOG_FORMATS, TEXT, VersionAction

WORKLOAD_CHOICES = (AUTO, *WORKLOADS)


# ---- where the host is ------------------------------------------------------------------


def absolute_path(value: str) -> str:
    """An absolute host path (argparse type), normalised as the chart's values may be
    written (``/srv/node/`` is ``/srv/node``)."""
    if not value.startswith("/"):
        raise argparse.ArgumentTypeError(f"{value!r} is not an absolute path")
    return str(PurePosixPath(value))


def add_host_root(parser) -> None:
    """``--host-root`` (``parser`` may be a mutually exclusive group)."""
    parser.add_argument("--host-root", default="/", metavar="DIR",
                        help="where the node's / is mounted (default /; /host in the chart's DaemonSets)")


def host_root(args: argparse.Namespace) -> Path:
    """The ``--host-root`` directory; ConfigError (exit 2) naming it when it is none."""
    root = Path(args.host_root)
    if not root.is_dir():
        raise ConfigError(f"--host-root {args.host_root!r} is not a directory; pass where the "
                          "node's / is mounted")
    return root


def add_runtime_root(parser) -> None:
    parser.add_argument("--runtime-root", default="/", metavar="DIR", type=absolute_path,
                        help="where the node's / is as the kubelet and containerd see it, for the device "
                             "nodes CDI specs and Allocate answers name and the sockets the kubelet dials "
                             "(default /; the chart passes hostPaths.rootFS)")


def add_kubelet_dir(parser) -> None:
    parser.add_argument("--kubelet-dir", default=KUBELET_DIR, metavar="DIR", type=absolute_path,
                        help="the kubelet's root directory (its --root-dir) on the host, where its "
                             "pod-resources, plugins and plugins_registry dirs are (default: "
                             f"{KUBELET_DIR}; the chart passes hostPaths.kubeletRootDir)")


def add_containerd_config(parser) -> None:
    parser.add_argument("--containerd-config", default=katadetect.CONTAINERD_CONFIG, metavar="PATH",
                        type=absolute_path,
                        help="containerd's config on the host, where the node's Kata runtimes are found "
                             "(their release decides, where --kata-version gives none, whether NVSwitches "
                             f"are advertised; default: {katadetect.CONTAINERD_CONFIG})")


# ---- which node, what it runs --------------------------------------------------------------


def add_node_name(parser) -> None:
    parser.add_argument("--node-name", metavar="NAME", default=os.environ.get("NODE_NAME"),
                        help="this node's name, to read and follow its labels (the DRA driver: its "
                             "slice's pool and spec.nodeName; default: $NODE_NAME)")


class DeprecatedAlias(argparse.Action):
    """An older spelling of an option: it still works, and says on stderr what to write."""

    def __init__(self, option_strings, dest, *, instead: str, **kwargs):
        self.instead = instead
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {self.instead} "
              "(it takes the same values)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_workload(parser) -> None:
    parser.add_argument("--workload", choices=WORKLOAD_CHOICES, default=AUTO,
                        help="the node's workload (default auto: the node label nvidia.com/gpu.workload.config, "
                             "read through the Kubernetes API when --node-name is known, and followed by the "
                             "long-running commands; a node without the label runs --default-workload; with no "
                             "node name or no cluster credentials the program's own fallback decides: katamgr "
                             "vm-passthrough, the plugins what the host shows. A label value that is not a "
                             "workload mode exits 2 and a failed read exits 1)")


def add_default_workload(parser) -> None:
    parser.add_argument("--default-workload", choices=WORKLOADS, default=DEFAULT_WORKLOAD.value,
                        help="the workload of a node without the nvidia.com/gpu.workload.config label "
                             f"(the chart: sandboxWorkloads.defaultWorkload; default {DEFAULT_WORKLOAD}, as "
                             "the GPU Operator's)")


def add_node(parser) -> None:
    """The node's name and its workload setting, as every program takes them."""
    add_node_name(parser)
    add_workload(parser)
    add_default_workload(parser)


# ---- the process ---------------------------------------------------------------------


def add_version(parser) -> None:
    parser.add_argument("--version", action=VersionAction,
                        help=f"print the program's name and the version of {DISTRIBUTION}, then exit")


def add_log_format(parser) -> None:
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=TEXT,
                        help="text (the default: time level logger: message) or json "
                             "(one object per line: time, level, logger, message, exception)")


def add_verbose(parser, help_text: str = "log every step") -> None:
    parser.add_argument("-v", "--verbose", action="store_true", help=help_text)


def add_metrics_address(parser) -> None:
    parser.add_argument("--metrics-address", metavar="HOST:PORT",
                        help="serve /metrics (Prometheus), /healthz and /readyz there (default: off)")


def metrics_address(args: argparse.Namespace) -> str | None:
    """``--metrics-address`` checked; ConfigError naming it when it is no HOST:PORT."""
    if not args.metrics_address:
        return None
    from gpunode.services.metrics_server import parse_address

    try:
        parse_address(args.metrics_address)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return args.metrics_address


# ---- which devices, under what names -------------------------------------------------------


def nvswitches_value(text: str) -> bool | str:
    """``--nvswitches``: auto, true or false, as the config and the chart write it; the older
    yes and no still work, with a warning."""
    value = text.lower()
    older = {"yes": "true", "no": "false"}
    if value in older:
        print(f"warning: --nvswitches {text} is deprecated; write --nvswitches {older[value]}",
              file=sys.stderr)
        value = older[value]
    if value == AUTO:
        return AUTO
    if value in ("true", "false"):
        return value == "true"
    raise argparse.ArgumentTypeError(f"{text!r} is not one of auto, true, false")


def add_selection(parser) -> None:
    """The device selection (``gpunode.policy.selection``): every program must select alike."""
    parser.add_argument(
        sel.INCLUDE_FLAG, action="append", default=[], metavar="VENDOR:DEVICE=RESOURCE",
        help="also pass through every device with these PCI ids, advertised as the extended "
             "resource RESOURCE (domain/name), e.g. 1234:11e8=example.com/edu (repeatable; "
             "by default only NVIDIA GPUs, and NVSwitches where Kata can take them, are passed through)")
    parser.add_argument(
        sel.EXCLUDE_FLAG, action="append", default=[], metavar="BDF|VENDOR:DEVICE",
        help="never pass through this device (full PCI address 0000:01:00.0) or these PCI ids "
             "(10de:1eb8), e.g. a GPU the host's display needs; it stays on its driver, and an "
             "IOMMU group it shares with a selected device is left alone (repeatable; wins over "
             f"{sel.INCLUDE_FLAG})")
    parser.add_argument(
        sel.NVSWITCHES_FLAG, type=nvswitches_value, default=None, metavar="{auto,true,false}",
        help="pass NVIDIA NVSwitches through: auto (default) where the node's Kata cold-plugs them "
             f"(Kata 4.1 or later, by {sel.KATA_VERSION_FLAG}), true always, false never (the chart's "
             "devices.nvswitches). Kata before 4.1 fails every sandbox given an NVSwitch")
    parser.add_argument(
        sel.KATA_VERSION_FLAG, default=None, metavar="RELEASE",
        help="the Kata Containers release the node runs (containerd-shim-kata-v2 --version), e.g. "
             "3.25.0; what its cold-plug can take (default or empty: found in containerd's config)")


def _parsed(texts, parse, flag: str) -> list:
    try:
        return [parse(text) for text in texts or []]
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None


def selection_from(args: argparse.Namespace, base: sel.Selection = sel.DEFAULT_SELECTION) -> sel.Selection:
    """``base`` (the config's rules) with the command line's added; ValueError naming the
    option and the bad value."""
    include = _parsed(args.include_device, sel.parse_include, sel.INCLUDE_FLAG)
    exclude = _parsed(args.exclude_device, sel.parse_exclude, sel.EXCLUDE_FLAG)
    merged = base.merged(sel.Selection(tuple(include), tuple(exclude)))
    nvswitches = getattr(args, "nvswitches", None)
    return dataclasses.replace(merged, nvswitches=merged.nvswitches if nvswitches is None else nvswitches)


def kata_release_from(args: argparse.Namespace, base: KataRelease = UNKNOWN) -> KataRelease:
    """The Kata release typed by hand: ``--kata-version``, else ``base`` (the config's
    devices.kataVersion); UNKNOWN where neither says, and the node's Kata is found instead.
    ValueError naming the option and the bad value."""
    try:
        return parse_release(args.kata_version) if getattr(args, "kata_version", None) else base
    except ValueError as exc:
        raise ValueError(f"{sel.KATA_VERSION_FLAG}: {exc}") from None


def add_naming(parser) -> None:
    """The naming options (``gpunode.policy.naming``): katamgr's CDI specs are named like the
    plugins' resources, so every program names alike."""
    parser.add_argument("--pci-ids", metavar="FILE",
                        help="pci.ids database for model names (default: /usr/share/hwdata/pci.ids)")
    parser.add_argument("--resource-naming", choices=[r.value for r in names.ResourceNaming],
                        default=names.ResourceNaming.NVIDIA.value,
                        help="how model names become resource names: nvidia (default; NVIDIA's sandbox "
                             "device plugin byte for byte, e.g. nvidia.com/GA107GL_A2___A16) or compact "
                             "(repeated underscores merged, e.g. nvidia.com/GA107GL_A2_A16)")
    parser.add_argument("--alias", metavar="NAME",
                        help="advertise every passthrough GPU as nvidia.com/NAME (e.g. pgpu) "
                             "instead of one resource per model (empty: per model)")
    parser.add_argument("--nvswitch-alias", metavar="NAME",
                        help="advertise every NVSwitch as nvidia.com/NAME instead of per model (empty: per model)")


def naming_from(args: argparse.Namespace, selection: sel.Selection = sel.DEFAULT_SELECTION) -> names.Naming:
    """The Naming the options ask for, selecting by ``selection``; ValueError naming the
    bad option otherwise."""
    aliases = {}
    for option, value in (("--alias", args.alias), ("--nvswitch-alias", args.nvswitch_alias)):
        if value:
            try:
                aliases[option] = names.validate_alias(value)
            except ValueError as exc:
                raise ValueError(f"{option}: {exc}") from None
    try:
        pci_ids = PciIds.find(args.pci_ids)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    return names.Naming(pci_ids, aliases.get("--alias"), aliases.get("--nvswitch-alias"),
                        names.ResourceNaming(args.resource_naming), selection)


def add_devices(parser) -> None:
    """Which devices are passthrough devices and their names (selection, then naming)."""
    add_naming(parser)
    add_selection(parser)


# ---- the NVLink fabric -------------------------------------------------------------------


def add_fabric(parser) -> None:
    """The NVLink fabric options (``gpunode.services.nvlinkfabric``; the chart's devices.nvlinkFabric
    and devices.fabricManager); unset, the config's (katamgr) or the defaults."""
    parser.add_argument("--nvlink-fabric", choices=nf.MODELS, default=None,
                        help="NVSwitch boards, NVIDIA's virtualization model (Fabric Manager User Guide §4): "
                             "sharedNvswitch gives each pod one Fabric Manager partition, activated at "
                             "Allocate (§7); fullPassthrough passes NVSwitches with the GPUs (§6); off; "
                             "auto (default): sharedNvswitch where FM answers, else fullPassthrough where "
                             "Kata cold-plugs NVSwitches")
    parser.add_argument("--fabric-manager-address", default=None, metavar="ADDR",
                        help=f"FM's API: host:port or the host path of its unix socket (default: {DEFAULT_ADDRESS})")
    parser.add_argument("--fabric-manager-library", default=None, metavar="LIB",
                        help=f"FM's SDK library, a soname or a host path (default: {DEFAULT_LIBRARY})")
    parser.add_argument("--gpu-module-ids", default=None, metavar="N=BDF[,N=BDF]",
                        help="each GPU's module ID (nvidia-smi -q) and PCI address, needed on HGX H100 and "
                             "later, where FM names a partition's GPUs by module ID only")


def fabric_from(args: argparse.Namespace, base: nf.FabricSettings | None = None) -> nf.FabricSettings:
    """``base`` (the config's; None: the defaults) with the options given; ValueError naming
    a bad --gpu-module-ids."""
    base = base or nf.FabricSettings()
    settings = nf.FabricSettings(
        args.nvlink_fabric or base.model,
        args.fabric_manager_address or base.address,
        args.fabric_manager_library or base.library,
        base.gpu_module_ids if args.gpu_module_ids is None else args.gpu_module_ids,
        base.timeout)
    try:
        settings.module_ids  # noqa: B018 - checked before anything is served
    except ValueError as exc:
        raise ValueError(f"--gpu-module-ids: {exc}") from None
    return settings


# ---- the health policy --------------------------------------------------------------------

LINK_POLICY_FLAG = "--link-policy"


def add_health(parser) -> None:
    """``--link-policy`` (``gpunode.policy.health.LINK_POLICIES``): the plugins and the agent's
    hand-back check must judge a GPU's link alike, or one offers what the other fails."""
    parser.add_argument(LINK_POLICY_FLAG, choices=health.LINK_POLICIES, default=None,
                        help=f"{health.LINK_POLICY_MEANING} (the chart's devices.linkPolicy; unset: the config's, "
                             f"else {health.DEFAULT_LINK_POLICY})")


def add_node_options(parser) -> None:
    """What the plugins take as katamgr's node commands do: the host, the node and its
    workload, the devices and their names, the NVLink fabric, the health policy, the log
    format (katamgr adds them one by one among its own: ``--host-root`` beside ``--host``).
    Each program adds its own options beside them."""
    add_host_root(parser)
    add_runtime_root(parser)
    add_kubelet_dir(parser)
    add_node(parser)
    add_devices(parser)
    add_fabric(parser)
    add_health(parser)
    add_log_format(parser)
