"""What the node commands share: the host root, the config, the node's context
(``gpunode.services.nodecontext``: naming, Kata release, fabric, workload rule, link policy)
and the cluster they act with, worked out from the flags."""

from __future__ import annotations

import argparse
import contextlib
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpunode.host.root import HostRoot
from gpunode.policy.workload import Operand, by_hand, describe_opt_outs
from gpunode.services import nodecontext, simulator
from gpunode.services.nodecontext import NodeBase, NodeContext, WorkloadRule
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
    # A dir `katamgr simulate` made gets its emulated kernel back; any other root the real one.
    yield nodecontext.open_host(args)


def config_from(args: argparse.Namespace) -> KataManagerConfig | None:
    """The --config file's model, or None without one (ConfigError when it is bad)."""
    if not args.config:
        return None
    from katamgr.config import load_config  # pydantic: only when a config is given

    return load_config(args.config)


def node_base(config: KataManagerConfig | None) -> NodeBase:
    """What the --config file gives the node's context below the flags: its devices, its NVLink
    fabric, where the Kata found on the node is read (containerd's config, katamgr's artifacts
    dir) and whose release decides (the configured runtime classes)."""
    if config is None:
        return NodeBase()
    devices = config.devices
    return NodeBase(devices.selection, devices.fabric, config.containerd.config_path, config.artifacts_dir,
                    tuple(rc.name for rc in config.runtime_classes), devices.link_policy, devices.kata_release)


@contextlib.contextmanager
def node_context(args: argparse.Namespace, config: KataManagerConfig | None) -> Iterator[NodeContext]:
    """The node's context (``gpunode.services.nodecontext``) on the host ``host_from`` opens."""
    with host_from(args) as (host, extras):
        yield nodecontext.opened(args, host, extras, node_base(config))


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
    split_from: str | None = None  # the node pool the split came from; None: the label


def steps_and_context(args: argparse.Namespace, host: HostRoot, config: KataManagerConfig | None = None, *,
                      extras: NodeExtras = REAL_NODE) -> tuple[Steps, KataContext | None]:
    setup = node_setup(args, host, config, extras=extras)
    return setup.steps, setup.ctx


def node_setup(args: argparse.Namespace, host: HostRoot, config: KataManagerConfig | None = None, *,
               extras: NodeExtras = REAL_NODE, workload: WorkloadRule | None = None) -> NodeSetup:
    """``config``: the --config file already loaded (else it is loaded here); ``extras``: what
    the node brings (``host_from``), here the kubeconfig rule; ``workload``: the node context's
    workload rule (else the flags')."""
    if config is None:
        config = config_from(args)
    rule = workload or nodecontext.workload_rule(args)
    wants_cluster = (config is not None and not args.no_kata) or (rule.follows and rule.node_name)
    if wants_cluster or config is not None:
        from gpunode.services.apiclient import connect
        from katamgr import cluster  # the Kubernetes client costs a second: only when it is used
    api = connect(home_kubeconfig=extras.home_kubeconfig) if wants_cluster else None
    if rule.follows:
        def read_labels(node: str):
            from gpunode.services.kube import read_node_labels  # the Kubernetes client: only to ask

            return read_node_labels(api, node)

        resolved = rule.resolve(read_labels if api is not None else None, by_hand,
                                splits=config.split_pools if config is not None else ())
        opted_out, split, split_from = resolved.opted_out, resolved.split, resolved.split_from
        workload, why = resolved.workload, resolved.why
        if opted_out:
            why += f"; it opts out of {describe_opt_outs(opted_out)}"
        log.info("node workload %s: %s", workload, why)
    else:
        resolved = rule.resolve(None, by_hand)
        workload, why, opted_out, split, split_from = resolved.workload, resolved.why, frozenset(), None, None
    steps = Steps(vfio=not args.no_vfio, cdi=not args.no_cdi, kata=not args.no_kata, workload=workload)
    ctx = None
    if config is not None:
        from katamgr.pipeline.kata_runtime import KataContext

        ctx = KataContext(config, api, cluster.agent_namespace(),
                          manage_runtime_classes=not args.no_runtime_classes)
    return NodeSetup(steps, ctx, api, why, opted_out, split, split_from)


__all__ = ["NodeSetup", "by_hand", "config_from", "host_from", "node_base", "node_context",
           "node_labels", "node_setup", "steps_and_context"]
