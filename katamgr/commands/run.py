"""``katamgr run``: the node agent, and its --plan-only form."""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace

from katamgr.commands.setup import (
    NodeSetup,
    by_hand,
    config_from,
    fabric_settings,
    host_from,
    naming_from,
    node_kata_inputs,
    node_labels,
    node_setup,
    with_node_kata,
)
from katamgr.errors import ConfigError
from katamgr.host import cc
from katamgr.host.naming import Naming
from katamgr.host.root import HostRoot
from katamgr.pipeline.reconcile import full_plan


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
            default_workload=args.default_workload, fallback=by_hand)
        agent = Agent(host, naming, setup.steps, setup.ctx, force=args.force, wait=args.device_wait,
                      lock_wait=args.wait,
                      repull_interval=args.repull_interval, revert_on_exit=args.revert_on_exit,
                      events=events, metrics_address=args.metrics_address,
                      read_workload=follower.read if follower else None,
                      node_watch=follower.watch.start() if follower else None, opted_out=setup.opted_out,
                      fabric=fabric_settings(args, host, config),
                      node_labels=None if args.no_gpu_labels or setup.api is None or not args.node_name
                      else node_labels(setup.api, args.node_name, follower.watch if follower else None),
                      offer_labels=None if setup.api is None or not args.node_name or setup.ctx is None
                      else node_labels(setup.api, args.node_name, follower.watch if follower else None),
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
        default_workload=args.default_workload, fallback=by_hand)
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
