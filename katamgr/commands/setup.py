"""What the node commands share: the host root, the config, the naming, the workload and
the cluster they act with, worked out from the flags."""

from __future__ import annotations

import argparse
import contextlib
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from gpunode.errors import ConfigError
from gpunode.host.root import HostRoot
from gpunode.policy import selection as device_selection
from gpunode.policy.naming import Naming
from gpunode.policy.workload import (
    AUTO,
    Operand,
    Workload,
    by_hand,
    describe_opt_outs,
    resolve_workload,
)
from gpunode.services import options, simulator
from gpunode.services.nvlinkfabric import FabricSettings
from gpunode.services.simulator import REAL_NODE, NodeExtras
from katamgr.pipeline.gpulabels import node_labels
from katamgr.pipeline.reconcile import Steps

if TYPE_CHECKING:
    from katamgr.config import KataManagerConfig
    from katamgr.pipeline.kata_runtime import KataContext

log = logging.getLogger("katamgr")


@contextlib.contextmanager
def host_from(args: argparse.Namespace) -> Iterator[tuple[HostRoot, NodeExtras]]:
    """The host root the command acts on and what its node brings (``gpunode.services.simulator``):
    a simulated node of the --host profile in a temp dir, or the --host-root."""
    if getattr(args, "host", None):
        sim = simulator.required(f"--host {args.host}")
        profile = sim.profile(args.host)
        with tempfile.TemporaryDirectory(prefix=f"katamgr-{profile.name}-") as tmp:
            log.info("simulating host profile %s in %s", profile.name, tmp)
            made = sim.materialise(args.host, Path(tmp) / "host")
            yield simulator.open_host(made.root, made.runtime_root)
        return
    root = options.host_root(args)
    # A dir `katamgr simulate` made gets its emulated kernel back; any other root the real one.
    yield simulator.open_host(root, getattr(args, "runtime_root", "/"))


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
    in containerd's config, ``gpunode.policy.katadetect``) where none was typed by hand."""
    import dataclasses

    from gpunode.policy import katadetect

    containerd, artifacts_dir, names = node_kata_inputs(config)
    return dataclasses.replace(naming, selection=katadetect.node_selection(
        naming.selection, host, containerd, artifacts_dir=artifacts_dir, names=names))


def with_fabric(naming: Naming, host: HostRoot, settings: FabricSettings) -> Naming:
    """``naming`` whose selection knows whether the node's NVLink fabric model keeps the
    NVSwitches on the host (``nvlinkfabric.keeps_nvswitches``): decided as ``plan`` decides it,
    asking FM only where ``auto`` needs its answer. The model does not hang on the Kata release
    where it keeps them (FM answering picks Shared NVSwitch whatever Kata takes), so this may
    come before ``with_node_kata``."""
    import dataclasses

    from gpunode.policy.inventory import discover
    from gpunode.services import nvlinkfabric as nf

    choice = None
    if settings.model == nf.AUTO:
        inv = discover(host, naming.selection)
        nvswitches = sum(1 for d in inv.devices if d.is_nvswitch)
        if nvswitches:
            kata = naming.selection.kata
            choice, _ = nf.decide(host, settings, nvswitches=nvswitches,
                                  gpus=sorted(d.bdf for d in inv.passthrough if d.is_gpu),
                                  kata_takes_nvswitches=kata.cold_plugs_nvswitches, kata=str(kata))
    if not nf.keeps_nvswitches(settings, choice):
        return naming
    return dataclasses.replace(naming, selection=dataclasses.replace(naming.selection,
                                                                     fabric_keeps_nvswitches=True))


def node_kata_inputs(config: KataManagerConfig | None) -> tuple[str, str, tuple[str, ...]]:
    """Where the node's Kata is found and whose release decides: containerd's config, katamgr's
    artifacts dir and the configured runtime classes."""
    from gpunode import kataclasses
    from gpunode.policy import katadetect

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
    split: str | None = None  # the node's split label (gpunode.policy.split); None: none read


def steps_and_context(args: argparse.Namespace, host: HostRoot, config: KataManagerConfig | None = None, *,
                      extras: NodeExtras = REAL_NODE) -> tuple[Steps, KataContext | None]:
    setup = node_setup(args, host, config, extras=extras)
    return setup.steps, setup.ctx


def node_setup(args: argparse.Namespace, host: HostRoot, config: KataManagerConfig | None = None, *,
               extras: NodeExtras = REAL_NODE) -> NodeSetup:
    """``config``: the --config file already loaded (else it is loaded here); ``extras``: what
    the node brings (``host_from``), here the kubeconfig rule."""
    if config is None:
        config = config_from(args)
    wants_cluster = (config is not None and not args.no_kata) or (args.workload == AUTO and args.node_name)
    if wants_cluster or config is not None:
        from gpunode.services.apiclient import connect
        from katamgr import cluster  # the Kubernetes client costs a second: only when it is used
    api = connect(home_kubeconfig=extras.home_kubeconfig) if wants_cluster else None
    if args.workload == AUTO:
        def read_labels(node: str):
            from gpunode.services.kube import read_node_labels  # the Kubernetes client: only to ask

            return read_node_labels(api, node)

        resolved = resolve_workload(
            args.node_name,
            read_labels if api is not None else None,
            default=args.default_workload,
            fallback=by_hand,
        )
        opted_out, split = resolved.opted_out, resolved.split
        workload, why = resolved.workload, resolved.why
        if opted_out:
            why += f"; it opts out of {describe_opt_outs(opted_out)}"
        log.info("node workload %s: %s", workload, why)
    else:
        workload, why, opted_out, split = Workload(args.workload), "chosen with --workload", frozenset(), None
    steps = Steps(vfio=not args.no_vfio, cdi=not args.no_cdi, kata=not args.no_kata, workload=workload)
    ctx = None
    if config is not None:
        from katamgr.pipeline.kata_runtime import KataContext

        ctx = KataContext(config, api, cluster.agent_namespace(),
                          manage_runtime_classes=not args.no_runtime_classes)
    return NodeSetup(steps, ctx, api, why, opted_out, split)


def fabric_settings(args: argparse.Namespace, config: KataManagerConfig | None,
                    extras: NodeExtras = REAL_NODE) -> FabricSettings:
    """The NVLink fabric settings: the config's (defaults without one), then the flags'; where
    the node brings its own Fabric Manager (a simulated node's), FM and its library unless told."""
    settings = FabricSettings()
    if config is not None:
        fm = config.devices.fabric_manager
        settings = FabricSettings(config.devices.nvlink_fabric, fm.address, fm.library, fm.gpu_module_ids)
    try:
        settings = options.fabric_from(args, settings)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    brought = extras.fabric_manager() if extras.fabric_manager is not None else None
    if brought is not None and (settings.address, settings.library) == (FabricSettings.address,
                                                                      FabricSettings.library):
        library, socket, modules = brought
        settings = replace(settings, address=socket, library=library,
                           gpu_module_ids=settings.gpu_module_ids or modules)
    return settings


__all__ = ["NodeSetup", "by_hand", "config_from", "fabric_settings", "host_from", "naming_from",
           "node_kata_inputs", "node_labels", "node_setup", "steps_and_context",
           "with_fabric", "with_node_kata"]
