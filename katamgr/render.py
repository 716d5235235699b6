"""Human-readable output: tables and reports a person reads at a terminal."""

from __future__ import annotations

from collections.abc import Sequence

from katamgr.plan import Plan


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
           f"{' (iommufd)' if plan.iommufd else ''}   vfio-pci: {plan.vfio_module}", ""]
    if plan.devices:
        rows = [
            (d.bdf, d.kind, d.model or d.ids, d.driver, d.iommu_group, d.numa_node, d.action, d.reason)
            for d in plan.devices
        ]
        out.append(table(("BDF", "KIND", "MODEL", "DRIVER", "GROUP", "NUMA", "ACTION", "REASON"), rows))
    else:
        out.append("No NVIDIA devices found.")
    out.append("")
    if plan.resources:
        out.append("Schedulable after apply (one unit per IOMMU group):")
        out += [f"  {name}: {count}" for name, count in plan.resources.items()]
    else:
        out.append("Schedulable after apply: nothing.")
    out += [f"  note: {n}" for n in plan.naming_notes]
    for section in plan.sections:
        out += ["", f"{section.title}:", *[f"  {line}" for line in section.lines]]
    if plan.problems:
        out += ["", "Problems:", *[f"  - {p}" for p in plan.problems]]
    return "\n".join(out)
