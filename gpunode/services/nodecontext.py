"""The node's resolved context: what every node program (``katamgr``'s node commands, the
device plugin, the DRA driver) works out about its node before it wires its own parts, built
by one function (``build``) in one order, so the three decide alike.

=====  ===================  ==========================================================
step   what                 from
=====  ===================  ==========================================================
1      host and extras      ``--host-root``/``--runtime-root``: the ``HostRoot`` and what
                            the node brings (``simulator.open_host``; a simulated node's
                            kernel, NVML, Fabric Manager, kubeconfig rule)
2      device selection     the config's ``devices`` (katamgr's ``--config``), then the
                            flags (``options.selection_from``, ``options.kata_release_from``)
3      Kata release         the Kata runtimes containerd registers (``katadetect``), where
                            ``--kata-version`` types none; a typed one stays the override
4      fabric model         NVSwitch boards: NVIDIA's model (``nvlinkfabric.decide``, FM
                            asked only where ``auto`` needs its answer), and whether the
                            NVSwitches stay on the host with Fabric Manager
5      naming               the resource names (``options.naming_from``) over the
                            selection, with the ``NvswitchRule`` steps 3 and 4 resolved
6      workload rule        ``--workload`` (fixed, or ``auto``: the node's label, then
                            ``--default-workload``, then the program's fallback)
7      health policy        ``--link-policy`` (then the config's ``devices.linkPolicy``)
=====  ===================  ==========================================================

A program's main parses its command line, calls ``build`` (or ``opened``, where katamgr
opens a simulated ``--host`` itself), then wires its own parts from the context; an
import-linter contract keeps the entry points from calling the steps' functions themselves.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpunode import kataclasses
from gpunode.errors import ConfigError
from gpunode.host.root import KUBELET_DIR, HostRoot
from gpunode.policy import health, katadetect
from gpunode.policy import selection as sel
from gpunode.policy.inventory import discover
from gpunode.policy.katarelease import UNKNOWN, KataRelease
from gpunode.policy.naming import Naming
from gpunode.policy.split import SplitPool
from gpunode.policy.workload import AUTO, Resolution, Workload, resolve_workload
from gpunode.services import nvlinkfabric as nf
from gpunode.services import options, simulator
from gpunode.services.simulator import REAL_NODE, NodeExtras

# The fabric step's way of asking FM: (host, settings, the board's GPUs) -> (FM's partitions
# matched to them, None) or (None, why FM did not answer); ``nvlinkfabric.read_fabric``'s shape.
Ask = Callable[[HostRoot, nf.FabricSettings, list[str]], tuple["nf.Fabric | None", "str | None"]]


@dataclass(frozen=True)
class NodeBase:
    """What a program's own configuration gives below the command line (katamgr's
    ``--config``; the plugins have none): the device selection, the NVLink fabric settings,
    where the Kata found on the node is read and whose release decides, the link policy."""

    selection: sel.Selection = sel.DEFAULT_SELECTION
    fabric: nf.FabricSettings = field(default_factory=nf.FabricSettings)
    containerd_config: str | None = None  # None: --containerd-config, else containerd's default
    artifacts_dir: str = ""
    runtime_classes: tuple[str, ...] = kataclasses.DEFAULT_RUNTIME_CLASSES
    link_policy: str | None = None
    kata: KataRelease = UNKNOWN  # devices.kataVersion: the release typed by hand (UNKNOWN: found)


@dataclass(frozen=True)
class WorkloadRule:
    """Step 6: the node's workload setting and how ``auto`` resolves (the node's label
    ``nvidia.com/gpu.workload.config``, then ``default``, then the program's fallback)."""

    node_name: str | None
    setting: str = AUTO
    default: str | None = None

    @property
    def follows(self) -> bool:
        """Whether the workload follows the node's label (``--workload auto``)."""
        return self.setting == AUTO

    def resolve(self, read_labels: Callable[[str], dict[str, str]] | None,
                fallback: Callable[[], tuple[Workload, str]] | None = None,
                splits: Sequence[SplitPool] = ()) -> Resolution:
        """The workload now: the one ``--workload`` fixes, or the label's (``read_labels``;
        None: no cluster to ask) as ``gpunode.policy.workload.resolve_workload`` rules, with the
        program's ``fallback`` where neither a label nor a cluster answers (``auto`` needs one)."""
        if not self.follows:
            return Resolution(Workload(self.setting), "chosen with --workload")
        if fallback is None:
            raise ValueError("--workload auto needs the program's fallback")
        return resolve_workload(self.node_name, read_labels, default=self.default, fallback=fallback,
                                splits=splits)


@dataclass(frozen=True)
class NodeContext:
    """The node as every program resolves it (``build``): ``given`` is the naming the operator
    gave (config, then flags) whose NVSwitch rule holds the release typed (if any) and the fabric
    model's NVSwitch decision (step 4), ``naming`` the same whose rule decides by the Kata release
    found too (step 3; the agent finds it again when the node's Kata changes, from ``given``'s
    rule); ``fabric_choice`` is the model ``auto`` chose (None where it was not asked: no
    NVSwitch, or a model configured)."""

    host: HostRoot
    extras: NodeExtras
    base: NodeBase
    given: Naming
    naming: Naming
    containerd_config: str
    kata_found: katadetect.KataOnNode
    kata_warning: str
    fabric: nf.FabricSettings
    fabric_choice: nf.ModelChoice | None
    keeps_nvswitches: bool
    workload: WorkloadRule
    link_policy: str

    @property
    def selection(self) -> sel.Selection:
        return self.naming.selection

    @property
    def nvswitch_rule(self) -> sel.NvswitchRule:
        """The NVSwitch rule's inputs as the node resolved them: the Kata release that decides
        and whether the fabric model keeps the NVSwitches on the host (steps 3 and 4)."""
        return self.naming.nvswitch_rule

    @property
    def kata(self) -> KataRelease:
        """The Kata release that decides what the node's Kata cold-plugs."""
        return self.nvswitch_rule.kata

    @property
    def fabric_model(self) -> str | None:
        """The model the node follows: the one configured, or ``auto``'s choice."""
        if self.fabric_choice is not None:
            return self.fabric_choice.model
        return None if self.fabric.model in (nf.AUTO, nf.OFF) else self.fabric.model


def open_host(args: argparse.Namespace) -> tuple[HostRoot, NodeExtras]:
    """Step 1: the ``--host-root`` (ConfigError naming it when it is no directory) and what
    its node brings; a root ``katamgr simulate`` made gets its emulated kernel back."""
    try:
        return simulator.open_host(options.host_root(args), getattr(args, "runtime_root", "/"),
                                   getattr(args, "kubelet_dir", None) or KUBELET_DIR)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def build(args: argparse.Namespace, base: NodeBase | None = None, *, ask: Ask | None = None,
          read_version: katadetect.VersionReader | None = None) -> NodeContext:
    """The node's context from a program's parsed options (``options.add_node_options``, or
    katamgr's own spelling of them), in the documented order. ``ask``: how the fabric step
    asks Fabric Manager (default ``nvlinkfabric.read_fabric``). ConfigError (exit 2) names a
    bad option."""
    host, extras = open_host(args)
    return opened(args, host, extras, base, ask=ask, read_version=read_version)


def opened(args: argparse.Namespace, host: HostRoot, extras: NodeExtras = REAL_NODE,
           base: NodeBase | None = None, *, ask: Ask | None = None,
           read_version: katadetect.VersionReader | None = None) -> NodeContext:
    """``build`` from step 2 on, for a host already opened (katamgr's ``--host PROFILE``)."""
    base = base or NodeBase()
    try:
        operator = options.naming_from(args, options.selection_from(args, base.selection))  # 2, 5
        typed = typed_rule(args, base)
        fabric = _fabric_settings(args, base.fabric, extras)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    containerd = (base.containerd_config or getattr(args, "containerd_config", None)
                  or katadetect.CONTAINERD_CONFIG)
    # 3: the Kata release found on the node, where none was typed.
    deciding, kata_found = katadetect.on_node(typed, host, containerd,
                                              artifacts_dir=base.artifacts_dir, names=base.runtime_classes,
                                              **({"read_version": read_version} if read_version else {}))
    # 4: the fabric model, decided as plan decides it; the NVSwitches kept for FM or not. Where
    # it keeps them the model does not hang on the Kata release (FM answering picks Shared
    # NVSwitch whatever Kata takes), so the decision holds while the release found changes.
    choice = _fabric_choice(host, fabric, operator.selection, deciding, ask)
    keeps = nf.keeps_nvswitches(fabric, choice)

    # 5: the naming over the selection, with the NVSwitch rule 3 and 4 resolved.
    given = dataclasses.replace(operator, nvswitch_rule=dataclasses.replace(typed, fabric_keeps_nvswitches=keeps))
    naming = dataclasses.replace(operator, nvswitch_rule=dataclasses.replace(deciding, fabric_keeps_nvswitches=keeps))
    return NodeContext(host, extras, base, given, naming, containerd, kata_found, kata_found.warning,
                       fabric, choice, keeps, workload_rule(args), link_policy(args, base))


def typed_rule(args: argparse.Namespace, base: NodeBase | None = None) -> sel.NvswitchRule:
    """Step 2's NVSwitch rule: the Kata release typed by hand (``--kata-version``, else the
    config's devices.kataVersion; unknown where neither says) and no fabric model yet.
    ValueError naming the option and the bad value."""
    return sel.NvswitchRule(options.kata_release_from(args, base.kata if base is not None else UNKNOWN))


def workload_rule(args: argparse.Namespace) -> WorkloadRule:
    """Step 6: ``--node-name``, ``--workload`` and ``--default-workload`` as a rule."""
    return WorkloadRule(getattr(args, "node_name", None), getattr(args, "workload", AUTO),
                        getattr(args, "default_workload", None))


def link_policy(args: argparse.Namespace, base: NodeBase | None = None) -> str:
    """Step 7: ``--link-policy``, else the config's ``devices.linkPolicy``, else the default."""
    return (getattr(args, "link_policy", None) or (base.link_policy if base is not None else None)
            or health.DEFAULT_LINK_POLICY)


def _fabric_settings(args: argparse.Namespace, base: nf.FabricSettings, extras: NodeExtras) -> nf.FabricSettings:
    """The config's settings, then the flags'; where the node brings its own Fabric Manager
    (a simulated node's), FM and its library unless told."""
    settings = options.fabric_from(args, base)
    brought = extras.fabric_manager() if extras.fabric_manager is not None else None
    default = nf.FabricSettings()
    if brought is not None and (settings.address, settings.library) == (default.address, default.library):
        library, socket, modules = brought
        settings = dataclasses.replace(settings, address=socket, library=library,
                                       gpu_module_ids=settings.gpu_module_ids or modules)
    return settings


def _fabric_choice(host: HostRoot, settings: nf.FabricSettings, selection: sel.Selection,
                   rule: sel.NvswitchRule, ask: Ask | None) -> nf.ModelChoice | None:
    """``auto``'s model on an NVSwitch board; None without NVSwitches or with a model configured.
    The GPUs asked about are the passthrough GPUs, as ``plan`` lists them."""
    if settings.model != nf.AUTO:
        return None
    inv = discover(host, selection, rule)
    nvswitches = sum(1 for d in inv.devices if d.is_nvswitch)
    if not nvswitches:
        return None
    gpus = sorted(d.bdf for d in inv.passthrough if d.is_gpu)
    kata = rule.kata
    return nf.decide(host, settings, nvswitches=nvswitches, gpus=gpus,
                     kata_takes_nvswitches=kata.cold_plugs_nvswitches, kata=str(kata),
                     ask=(lambda: ask(host, settings, gpus)) if ask is not None else None)[0]


__all__ = ["Ask", "NodeBase", "NodeContext", "WorkloadRule", "build", "link_policy", "open_host", "opened",
           "typed_rule", "workload_rule"]
