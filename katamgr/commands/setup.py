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

from katamgr.errors import ConfigError
from katamgr.host import selection as device_selection
from katamgr.host.naming import Naming
from katamgr.host.root import HostRoot
from katamgr.host.workload import (
    AUTO,
    Operand,
    Workload,
    describe_opt_outs,
    resolve_workload,
)
from katamgr.node import options
from katamgr.node.nvlinkfabric import FabricSettings
from katamgr.pipeline.reconcile import Steps
from nodesim.materialise import materialise
from nodesim.node import open_node, open_root
from nodesim.profiles import find_profile

if TYPE_CHECKING:
    from katamgr.config import KataManagerConfig
    from katamgr.pipeline.kata_runtime import KataContext

log = logging.getLogger("katamgr")


@contextlib.contextmanager
def host_from(args: argparse.Namespace) -> Iterator[HostRoot]:
    if getattr(args, "host", None):
        profile = find_profile(args.host)
        with tempfile.TemporaryDirectory(prefix=f"katamgr-{profile.name}-") as tmp:
            log.info("simulating host profile %s in %s", profile.name, tmp)
            yield materialise(profile, Path(tmp) / "host")
        return
    root = options.host_root(args)
    # A dir `katamgr simulate` made gets its emulated kernel back; any other root the real one.
    yield open_root(root, getattr(args, "runtime_root", "/"))


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


def by_hand() -> tuple[Workload, str]:
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
            fallback=by_hand,
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


def node_labels(api: object, node_name: str, watch=None):
    """Our Node's labels for the GPU labels: read (from the watch when there is one) and patched."""
    from katamgr.cluster import set_node_labels
    from katamgr.node.kube import read_node_labels
    from katamgr.pipeline.gpulabels import NodeLabels

    def fresh():
        return read_node_labels(api, node_name)

    return NodeLabels(watch.labels if watch is not None else fresh,
                      lambda labels: set_node_labels(api, node_name, labels),
                      fresh if watch is not None else None)
