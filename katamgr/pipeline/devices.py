"""The device step: bind what the plan says to vfio-pci, write the readiness files; undo both."""

from __future__ import annotations

import logging

from gpunode.host import vfio, vfiogroups
from gpunode.host.root import HostRoot
from gpunode.host.vfiogroups import Action
from gpunode.policy import readiness as readiness_files
from gpunode.policy.splitnode import SIDES_FILE, clear_sides
from gpunode.policy.workload import Workload
from gpunode.services import interrupt
from gpunode.services.journal import Journal, quiet
from katamgr.pipeline.plan import Plan
from katamgr.pipeline.report import Report

log = logging.getLogger(__name__)


def apply_host(host: HostRoot, plan: Plan, *, workload: Workload | str = Workload.VM_PASSTHROUGH,
               wait: float = 5.0, readiness: bool = True, journal: Journal | None = None) -> Report:
    """Bind what the plan says to bind, then write the readiness files (unless the node
    opts out of them: ``nvidia.com/gpu.deploy.sandbox-validator=false``); each group is a
    step of ``journal``."""
    journal = journal or quiet()
    report = Report()
    # One group at a time: a group moves whole or is rolled back, so a group
    # without a failure moved exactly the devices the plan said it would.
    for decision in (d for d in plan.decisions if d.to_move):
        if decision.forced:
            # Named before the unbind: each of these processes loses its device now.
            taken = [f"--force: {device.bdf} is taken from {holder}" for device in decision.to_move
                     for holder in vfiogroups.in_use(host, [device])]
            report.forced += taken
            report.warnings += taken
        bdfs = ", ".join(d.bdf for d in decision.to_move)
        with journal.step(f"bind IOMMU group {decision.group} ({bdfs}) to VFIO") as step:
            with interrupt.deferred():  # a group moves whole or is rolled back: never cut half-way
                result = vfio.bind(host, [decision], wait=wait)
            step.failed = bool(result.failures)
        report.changes += result.changes
        report.failures += result.failures
        if not result.failures:
            report.moved += [d.bdf for d in decision.to_move]
        for change in result.changes:
            log.info("%s", change)
    usable = any(d.action in (Action.BIND, Action.KEEP) for d in plan.decisions)
    if report.ok and usable and readiness:
        with journal.step("write the readiness files"):
            report.changes += [f"wrote {p}" for p in readiness_files.mark_ready(host, workload)]
    return report


def revert_host(host: HostRoot, *, force: bool = False) -> Report:
    report = Report()
    try:
        report.changes += [f"removed {p}" for p in readiness_files.clear_ready(host)]
    except OSError as exc:  # a read-only /run/nvidia: the GPUs are given back all the same
        report.failures.append(f"the readiness files in {readiness_files.VALIDATIONS} were not removed "
                               f"({exc.strerror or exc}); left as they are")
    result = vfio.unbind_all(host, force=force)
    report.changes += result.changes
    report.failures += result.failures
    # A split node's published sides (gpunode.policy.splitnode): with the GPUs back on their
    # drivers no split is carried out, and a reverted node keeps no trace of katamgr.
    try:
        report.changes += [f"removed {p}" for p in clear_sides(host)]
    except OSError as exc:
        report.failures.append(f"{SIDES_FILE} (the split's published sides) was not removed "
                               f"({exc.strerror or exc}); left as it is")
    return report
