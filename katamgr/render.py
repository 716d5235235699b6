"""Human-readable output: tables and reports a person reads at a terminal."""

from __future__ import annotations

import logging
import sys
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, TextIO

from katamgr.output import tables
from katamgr.pipeline.plan import DevicePlan, Plan
from katamgr.pipeline.report import Report

if TYPE_CHECKING:  # the records' reader brings containerd's TOML library: only for status
    from katamgr.pipeline.status import NodeStatus


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Rows under their headers, every cell in full (the plan's sections, the demo's story)."""
    return tables.table([tables.Column(h) for h in headers], rows)


# The plan's device table: the default columns fit an 80-100 column terminal (the prose
# ones cut to fit); ``-o wide`` adds the rest and shows every cell in full.
_DEFAULT = (tables.Column("BDF"), tables.Column("KIND"), tables.Column("MODEL", floor=10),
            tables.Column("DRIVER", floor=8), tables.Column("GROUP"), tables.Column("CC MODE"),
            tables.Column("ACTION"), tables.Column("REASON", floor=12))
_WIDE = (*_DEFAULT[:4], tables.Column("VFIO DRIVER"), tables.Column("GROUP"), tables.Column("NUMA"),
         tables.Column("CC MODE"), tables.Column("RESOURCE"), tables.Column("ACTION"),
         tables.Column("REASON"), tables.Column("SELECTION"))


def cc_mode_text(device: DevicePlan, *, wide: bool = False) -> str | None:
    """A device's CC mode for the table: the mode read, "n/a" (not capable), "unread" (why, wide)."""
    if device.cc_mode is not None:
        return device.cc_mode
    if device.cc_capable is None:
        return None
    if not device.cc_capable:
        return "not capable" if wide else "n/a"
    return f"unread ({device.cc_mode_message})" if wide and device.cc_mode_message else "unread"


def device_table(plan: Plan, *, width: int | None = None, wide: bool = False, headers: bool = True) -> str:
    """The plan's devices as a table; ``width`` (default: the terminal's) is ignored when ``wide``."""
    if wide:
        rows = [(d.bdf, d.kind, d.model or d.ids, d.driver, d.vfio_driver, d.iommu_group, d.numa_node,
                 cc_mode_text(d, wide=True), d.resource, d.action, d.reason, d.selection) for d in plan.devices]
        return tables.table(_WIDE, rows, headers=headers)
    rows = [(d.bdf, d.kind, d.model or d.ids, d.driver, d.iommu_group, cc_mode_text(d), d.action, d.reason)
            for d in plan.devices]
    return tables.table(_DEFAULT, rows, width=width or tables.terminal_width(), headers=headers)


def plan_text(plan: Plan, *, width: int | None = None, wide: bool = False, headers: bool = True) -> str:
    """The plan for a person: every line fits ``width`` (default: the terminal's), prose
    wrapped and the table's long cells cut, unless ``wide`` (every cell and line in full)."""
    width = None if wide else (width or tables.terminal_width())
    head = [f"Host root: {plan.host_root}   IOMMU: {'on' if plan.iommu_enabled else 'OFF'}"
            f"{' (iommufd)' if plan.iommufd else ''}   vfio-pci: {plan.vfio_module}"]
    if plan.workload:
        why = f" ({plan.workload['why']})" if plan.workload.get("why") else ""
        head.append(f"Workload: {plan.workload['mode']}{why}")
    head.append("")
    body = [device_table(plan, width=width, wide=wide, headers=headers) if plan.devices
            else "No passthrough devices found."]
    tail = [f"  {d.bdf}: {d.vfio_driver_why}" for d in plan.devices
            if d.vfio_driver and d.vfio_driver != "vfio-pci" and d.vfio_driver_why and d.action == "bind"]
    health = [d for d in plan.devices if d.health is not None]
    if health:
        tail += ["", "Health (what the host kernel shows):"]
        tail += [f"  {d.bdf}: {d.health}" for d in health]
        tail += [f"  {d.bdf}: unfit for a VM: {u}" for d in health for u in d.unfit]
    tail.append("")
    if plan.resources:
        tail.append("Schedulable after apply (one unit per IOMMU group):")
        tail += [f"  {name}: {count}" for name, count in plan.resources.items()]
    else:
        tail.append("Schedulable after apply: nothing.")
    tail += [f"  note: {n}" for n in plan.naming_notes]
    for section in plan.sections:
        tail += ["", f"{section.title}:", *[f"  {line}" for line in section.lines]]
    if plan.warnings:
        tail += ["", "Warnings:", *[f"  - {w}" for w in plan.warnings]]
    if plan.problems:
        tail += ["", "Problems:", *[f"  - {p}" for p in plan.problems]]
    if width is not None:
        head, tail = [wrap(line, width) for line in head], [wrap(line, width) for line in tail]
    return "\n".join([*head, *body, *tail])


def wrap(line: str, width: int) -> str:
    """A line of prose in lines of at most ``width``, continued under its text ("  - a..." -> "    b")."""
    if len(line) <= width:
        return line
    body = line.lstrip(" ")
    indent = " " * (len(line) - len(body))
    more = indent + ("  " if body.startswith("- ") else "  ")
    return textwrap.fill(body, width, initial_indent=indent, subsequent_indent=more,
                         break_long_words=True, break_on_hyphens=False)


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


# How each kind of line starts: at the command line (warnings and failures go to stderr), and in
# the demo's story (indented under its step, all on stdout).
COMMAND = {"changed": "changed: ", "warning": "warning: ", "error": "error: "}
STORY = {"changed": "  changed: ", "warning": "  note:    ", "error": "  ERROR:   "}


def print_report(report: Report, nothing: str = "", *, prefixes: dict[str, str] = COMMAND,
                 out: TextIO | None = None, errors: TextIO | None = None) -> None:
    """Print a report for a person: changes to ``out`` (default stdout), warnings and
    failures to ``errors`` (default stderr: a script reading stdout gets what changed, a
    person at a terminal sees both); ``nothing`` (when given) says that a quiet report is
    good news."""
    out = out or sys.stdout
    errors = errors or sys.stderr
    for line in report_lines(report):
        print(prefixes[line.kind] + line.text, file=out if line.kind == "changed" else errors)
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


# ---- status ------------------------------------------------------------------


def status_text(status: NodeStatus, *, width: int | None = None) -> str:
    """What katamgr installed on the node, from its records, for a person; each line wrapped
    to ``width`` (default: the terminal's)."""
    run = status.last_run
    out: list[str] = []
    if status.installed:
        out.append(f"katamgr {status.version or '(version not recorded)'} installed this node's changes"
                   + (f" (since {status.since})" if status.since else "") + f"; records in {status.state_dir}")
    else:
        out.append("Nothing installed: katamgr has no changes recorded on this node.")
    if status.devices:
        out += ["", "Devices on VFIO (revert gives each back to the driver it had):"]
        out += [f"  {d.bdf}  IOMMU group {d.iommu_group if d.iommu_group is not None else '-'}  "
                f"was on {d.driver_before or 'no driver'}" for d in status.devices]
    if status.cdi_specs:
        out += ["", "CDI specs:", *[f"  {p}" for p in status.cdi_specs]]
    if status.runtime_classes:
        out += ["", "Kata runtime classes (artifacts):"]
        out += [f"  {c.name}: {c.dir} from {c.ref}" + (f" (since {c.since})" if c.since else "")
                for c in status.runtime_classes]
    if status.containerd:
        out += ["", "containerd:"]
        out += [f"  {c.target}: runtimes {', '.join(c.runtimes) or '(none)'}"
                + (f" (in {c.config_path}'s drop-in)" if c.target != c.config_path else "")
                + f"; reloaded by {c.restart_mode}" for c in status.containerd]
    if status.drop_ins:
        out += ["", "Drop-ins beside kata-deploy's configs:", *[f"  {p}" for p in status.drop_ins]]
    if status.gpu_labels:
        out += ["", "GPU labels set on the Node:", *[f"  {k}={v}" for k, v in status.gpu_labels.items()]]
    if status.split is not None:
        vm, container = status.split
        out += ["", "GPU split (a GPU moving is on neither side):",
                f"  VMs: {', '.join(vm) or 'none'}", f"  containers: {', '.join(container) or 'none'}"]
        if status.split_from:
            out.append(f"  from: {status.split_from}")
    if run is not None:
        out += ["", f"Last run: {run.command} (katamgr {run.version}, pid {run.pid}), started {run.started}"]
        if run.outcome == "interrupted":
            out.append(f"  INTERRUPTED at: {run.step or 'between steps'} "
                       f"(after {len(run.steps_done)} steps done); run it again, or katamgr revert")
        elif run.outcome is None:
            out.append(f"  under way: {run.step or 'between steps'}")
        else:
            out.append(f"  {run.outcome} at {run.finished}")
        out += [f"  done: {step}" for step in run.steps_done]
    if status.problems:
        out += ["", "Problems:", *[f"  - {p}" for p in status.problems]]
    width = width or tables.terminal_width()
    return "\n".join(wrap(line, width) for line in out)
