"""Human-readable output: tables and reports a person reads at a terminal."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import NamedTuple, TextIO

from katamgr.pipeline.plan import Plan
from katamgr.pipeline.report import Report


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[("-" if c is None else str(c)) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, cell in enumerate(row[:-1]):
            widths[i] = max(widths[i], len(cell))
    def line(values: Sequence[str]) -> str:
        head = "  ".join(v.ljust(widths[i]) for i, v in enumerate(values[:-1]))
        return f"{head}  {values[-1]}".rstrip()
    return "\n".join([line(list(headers)), *(line(r) for r in cells)])


def plan_text(plan: Plan) -> str:
    out = [f"Host root: {plan.host_root}   IOMMU: {'on' if plan.iommu_enabled else 'OFF'}"
           f"{' (iommufd)' if plan.iommufd else ''}   vfio-pci: {plan.vfio_module}"]
    if plan.workload:
        why = f" ({plan.workload['why']})" if plan.workload.get("why") else ""
        out.append(f"Workload: {plan.workload['mode']}{why}")
    out.append("")
    if plan.devices:
        rows = [
            (d.bdf, d.kind, d.model or d.ids, d.driver, d.vfio_driver, d.iommu_group, d.numa_node,
             d.cc_mode, d.selection, d.action, d.reason)
            for d in plan.devices
        ]
        out.append(table(("BDF", "KIND", "MODEL", "DRIVER", "VFIO DRIVER", "GROUP", "NUMA", "CC MODE",
                          "SELECTION", "ACTION", "REASON"), rows))
        variants = [d for d in plan.devices if d.vfio_driver and d.vfio_driver != "vfio-pci"
                    and d.vfio_driver_why and d.action == "bind"]
        out += [f"  {d.bdf}: {d.vfio_driver_why}" for d in variants]
    else:
        out.append("No passthrough devices found.")
    out.append("")
    if plan.resources:
        out.append("Schedulable after apply (one unit per IOMMU group):")
        out += [f"  {name}: {count}" for name, count in plan.resources.items()]
    else:
        out.append("Schedulable after apply: nothing.")
    out += [f"  note: {n}" for n in plan.naming_notes]
    for section in plan.sections:
        out += ["", f"{section.title}:", *[f"  {line}" for line in section.lines]]
    if plan.warnings:
        out += ["", "Warnings:", *[f"  - {w}" for w in plan.warnings]]
    if plan.problems:
        out += ["", "Problems:", *[f"  - {p}" for p in plan.problems]]
    return "\n".join(out)


# ---- reports -----------------------------------------------------------------


class ReportLine(NamedTuple):
    kind: str  # "changed", "warning" or "error"
    text: str


def report_lines(report: Report) -> list[ReportLine]:
    """A report as lines, in the order every output shows them: changes, warnings, failures."""
    return [*(ReportLine("changed", c) for c in report.changes),
            *(ReportLine("warning", w) for w in report.warnings),
            *(ReportLine("error", f) for f in report.failures),
            *(ReportLine("error", why) for why in report.classes_failed.values())]


def quiet(report: Report) -> bool:
    """Nothing changed and nothing failed: the node already was as wanted."""
    return not report.changes and report.ok


# How each kind of line starts: at the command line (failures go to stderr), and in
# the demo's story (indented under its step, all on stdout).
COMMAND = {"changed": "changed: ", "warning": "warning: ", "error": "error: "}
STORY = {"changed": "  changed: ", "warning": "  note:    ", "error": "  ERROR:   "}


def print_report(report: Report, nothing: str = "", *, prefixes: dict[str, str] = COMMAND,
                 out: TextIO | None = None, errors: TextIO | None = None) -> None:
    """Print a report for a person: ``out`` (default stdout), failures to ``errors``
    (default stderr); ``nothing`` (when given) says that a quiet report is good news."""
    out = out or sys.stdout
    errors = errors or sys.stderr
    for line in report_lines(report):
        print(prefixes[line.kind] + line.text, file=errors if line.kind == "error" else out)
    if nothing and quiet(report):
        print(nothing, file=out)


def log_report(report: Report, log: logging.Logger, nothing: str = "") -> None:
    """Log a report (a daemon's only output): changes at INFO, warnings and failures at
    their own levels; ``nothing`` (when given) at INFO for a quiet report."""
    for line in report_lines(report):
        if line.kind == "changed":
            log.info("changed: %s", line.text)
        elif line.kind == "warning":
            log.warning("%s", line.text)
        else:
            log.error("%s", line.text)
    if nothing and quiet(report):
        log.info("%s", nothing)
