"""Drift: what someone else changed under the agent, found between reconciles.

The GPU Operator's kata manager misses it when someone else's containerd edit or restart
drops our runtime entries, so the agent watches the containerd config (inotify, not
polling) and re-applies only when our entries are really gone. The CDI specs follow the
devices on vfio-pci: a hotplug or a re-bind by hand must not leave Kata a name that no
longer resolves, or one that names another GPU.
"""

from __future__ import annotations

import logging
from pathlib import Path

from gpunode.services.lock import NodeBusyError, node_lock
from katamgr.agent.events import NodeEvents
from katamgr.agent.metrics import AgentMetrics
from katamgr.agent.target import Target
from katamgr.pipeline import cdi_specs, kata_runtime
from katamgr.pipeline.report import Report
from katamgr.render import log_report
from katamgr.runtime import check_entries, configure_containerd

# One logger for the agent, whichever module speaks: its log is a daemon's only voice.
log = logging.getLogger("katamgr.agent")


def containerd_dirs(target: Target) -> list[Path]:
    """The directories whose changes may drop our runtime entries (none without Kata)."""
    if target.ctx is None or not target.steps.kata:
        return []
    main = target.host.path(target.ctx.config.containerd.config_path)
    return [main.parent]


def containerd_drift(target: Target) -> str | None:
    """Why containerd's config no longer matches what we would write, if it does not."""
    ctx, steps = target.ctx, target.steps
    if ctx is None or not steps.kata or not steps.passthrough:
        return None
    wanted = kata_runtime.runtimes(target.host, ctx)
    if not wanted:
        return None
    containerd = ctx.config.containerd
    missing = check_entries(target.host, containerd.config_path, wanted)
    if missing:
        return f"containerd config lost our runtimes {', '.join(missing)} (edited or replaced by someone else)"
    # Our entries are there, but e.g. a 1.x drop-in must carry the operator's
    # later edits to the main file: a dry run says whether a write is due.
    change = configure_containerd(target.host, wanted, containerd.config_path, containerd.version,
                                  enable_cdi=steps.cdi, dry_run=True)
    if change.changed:
        return f"{change.path} differs from what katamgr would write (an edit elsewhere to carry over)"
    return None


def sync_cdi(target: Target, metrics: AgentMetrics, events: NodeEvents) -> Report | None:
    """Rewrite the CDI specs when the devices on vfio-pci changed under us
    (hotplug, a re-bind by hand), so every name Kata resolves stays true."""
    if not (target.steps.cdi and target.steps.passthrough):
        return None
    found, _ = cdi_specs.changes(target.host, target.scan(), target.naming)
    stale = [c for c in found if c.action != "keep"]
    if not stale:
        return None
    log.info("CDI specs out of step with the devices on vfio-pci (%s): rewriting",
             ", ".join(f"{c.action} {c.path}" for c in stale))
    try:
        # A lock taken by someone else is theirs to finish: no waiting, the next check looks again.
        with node_lock(target.host, "katamgr run (CDI specs)", 0):
            # Under the lock the devices may have moved on: look again.
            report = cdi_specs.write_specs(target.host, target.scan(), target.naming)
    except NodeBusyError:
        log.info("another katamgr holds the node lock; the CDI specs are checked again next time")
        return None
    log_report(report, log)
    metrics.cdi_syncs.inc()
    events.cdi_specs_synced(report)
    return report
