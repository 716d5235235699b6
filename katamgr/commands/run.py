"""``katamgr run``: the node agent, and its --plan-only form."""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace

from gpunode.errors import ConfigError
from gpunode.host import cc
from gpunode.services.lock import agent_lock
from gpunode.services.nodecontext import NodeContext
from katamgr.commands.setup import NodeSetup, by_hand, config_from, node_context, node_setup
from katamgr.pipeline.reconcile import full_plan


def cmd_run(args: argparse.Namespace) -> int:
    from katamgr.agent.build import build
    from katamgr.agent.katafound import KataFound
    from katamgr.agent.settings import AgentSettings

    # A daemon's log is its only voice: say what changed even without -v.
    logging.getLogger().setLevel(logging.INFO)
    if args.plan_only and (args.revert_on_exit or args.cc_manager):
        raise ConfigError(f"--plan-only changes nothing, so it cannot be given with "
                          f"{'--revert-on-exit' if args.revert_on_exit else '--cc-manager'}")
    config = config_from(args)
    if args.rejected_pods != "none" and not args.offer_gate:
        raise ConfigError(f"--rejected-pods {args.rejected_pods} looks for refused pods each time the offer gate "
                          "opens: give --offer-gate with it (the device plugin runs beside the agent)")
    if args.metrics_address:
        from gpunode.services.metrics_server import parse_address

        try:
            parse_address(args.metrics_address)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    with node_context(args, config) as node:
        host = node.host
        setup = node_setup(args, host, config, extras=node.extras, workload=node.workload)
        if args.plan_only:
            return _run_plan_only(args, node, setup)
        # The fabric model is decided once at start, as the NVSwitches' binding is: the agent
        # finds the Kata release again when the node's Kata changes, from the naming given.
        settings = AgentSettings(
            host, node.naming, setup.steps, setup.ctx, setup.opted_out, force=args.force, wait=args.device_wait,
            lock_wait=args.wait, repull_interval=args.repull_interval, revert_on_exit=args.revert_on_exit,
            metrics_address=args.metrics_address, fabric=node.fabric, link_policy=node.link_policy,
            kata_on_node=node.kata_found, kata_found=KataFound(node.given.nvswitch_rule, node.containerd_config,
                                                               node.base.artifacts_dir, node.base.runtime_classes),
            cc_default_mode=cc.CcMode(args.cc_default_mode) if args.cc_manager else None,
            node_name=args.node_name, workload=args.workload, default_workload=args.default_workload,
            follow=not args.once, gpu_labels=not args.no_gpu_labels,
            offer_gate=args.offer_gate, rejected_pods=args.rejected_pods)
        agent = build(settings, setup.api)
        # One agent per node, for its whole life (each reconcile takes the node lock besides).
        with agent_lock(host, "katamgr run" + (" --once" if args.once else ""), args.config, args.wait):
            return agent.run(once=args.once)


def _run_plan_only(args: argparse.Namespace, node: NodeContext, setup: NodeSetup) -> int:
    """``katamgr run --plan-only``: the plan, kept up to date and published, never carried out.
    The Node's labels are only read (by the watch when it follows them)."""
    from katamgr.agent.following import node_follower
    from katamgr.agent.planonly import PlanOnlyAgent

    follower = None if args.once else node_follower(
        setup.api, node.workload.node_name, workload=node.workload.setting,
        default_workload=node.workload.default, fallback=by_hand)
    watch = follower.watch.start() if follower else None

    def make_plan():
        steps, out, why = setup.steps, setup.opted_out, setup.workload_why
        if follower is not None:
            resolved = follower.read()
            steps, out, why = replace(steps, workload=resolved.workload), resolved.opted_out, resolved.why
        return full_plan(node.host, node.naming, steps.without(out), setup.ctx, force=args.force, workload_why=why,
                         gpu_labels=not args.no_gpu_labels, kata_found=node.kata_found)

    try:
        return PlanOnlyAgent(make_plan, metrics_address=args.metrics_address).run(once=args.once)
    finally:
        if watch is not None:
            watch.stop()
