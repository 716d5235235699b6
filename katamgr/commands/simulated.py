"""``katamgr simulate`` and ``katamgr demo``: the simulated node's commands."""

from __future__ import annotations

import argparse
import logging

from gpunode.services import simulator


def cmd_simulate(args: argparse.Namespace) -> int:
    sim = simulator.required("katamgr simulate")
    profile = sim.profile(args.profile)
    host = sim.materialise(args.profile, args.into, real_device_nodes=args.real_device_nodes)
    print(f"simulated {profile.name} ({profile.devices} PCI devices) in {host.root}")
    print(f"try: katamgr plan --host-root {host.root}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from katamgr.demo import run_demo

    if not args.verbose:
        # The demo tells its own story; library warnings would repeat it.
        logging.getLogger().setLevel(logging.ERROR)
    return run_demo(args, simulator.required("katamgr demo"))
