"""The node labels the agent keeps on its Node at every check: the GPU labels
(``nvidia.com/gpu.product``, ``.family``, ``.count``, ``.memory``, ``nvidia.com/cc.capable``)
and the Kata release found (``katacontainers.io/kata-version``): one
patch, only when something differs (``pipeline.gpulabels``); what it did or left to GFD/NFD is a
log line and an Event, each said once until it changes."""

from __future__ import annotations

import logging

from gpunode.errors import GpuNodeError
from katamgr.agent.events import NodeEvents
from katamgr.agent.target import Target
from katamgr.pipeline import gpulabels
from katamgr.pipeline.report import Report
from katamgr.render import log_report

log = logging.getLogger("katamgr.agent")  # the agent's one logger (see drift)


class GpuLabels:
    """Publishes the node labels (None ``node``: off, or no node name and cluster)."""

    def __init__(self, target: Target, events: NodeEvents, node: gpulabels.NodeLabels | None) -> None:
        self.target = target
        self.events = events
        self.node = node
        self._said: tuple[tuple[str, ...], tuple[str, ...]] | None = None

    def follow(self) -> Report | None:
        if self.node is None:
            return None
        t = self.target
        try:
            report = gpulabels.publish(t.host, t.scan(), t.naming, self.node, t.kata_found)
        except (GpuNodeError, OSError, ValueError) as exc:
            report = Report(failures=[f"cannot work out the node labels: {exc}"])
        said = (tuple(report.warnings), tuple(report.failures))
        if report.changes or said != self._said:
            log_report(report, log)
            self.events.gpu_labels(report)
        self._said = said
        return report
