"""The split in ``katamgr plan`` and ``apply``: the node's GPUs between VMs and containers by the
split label (``gpunode.policy.split``), and what carrying it out would move from the node as it
is now (a GPU on vfio-pci is on the VM side, one on its driver on the container side)."""

from __future__ import annotations

from gpunode.host.pci import is_vfio_driver
from gpunode.host.root import HostRoot
from gpunode.policy.naming import Naming
from gpunode.policy.split import SPLIT_LABEL, Moves
from gpunode.policy.splitnode import split_naming
from katamgr.pipeline.plan import PlanSection


def split_plan(host: HostRoot, naming: Naming, value: str | None,
               origin: str | None = None) -> tuple[Naming, PlanSection | None]:
    """``naming`` narrowed to the VM share of ``value`` (the label's, or the node pool ``origin``'s),
    and the plan's section saying the split, where it came from and what it moves (None where the
    node has no split and nothing to move back)."""
    split_to, share = split_naming(host, naming, value, origin)
    on_vfio = {d.bdf for d in (*share.vm, *share.container) if is_vfio_driver(d.driver)}
    change = Moves(tuple(d for d in share.vm if d.bdf not in on_vfio),
                   tuple(d for d in share.container if d.bdf in on_vfio))
    if value is None and not change.to_container:
        return split_to, None
    lines = [share.describe(), f"would move {change.describe()}" if change.to_vm or change.to_container
             else "nothing to move: every GPU is on its side", *share.notes]
    if change.to_vm or change.to_container:
        lines.append("a GPU a pod or VM holds moves once it is let go (katamgr run follows the label live)")
    data = {"label": SPLIT_LABEL, "value": value, "from": origin or ("label" if value is not None else None),
            "vm": [d.bdf for d in share.vm], "container": [d.bdf for d in share.container],
            "toVm": [d.bdf for d in change.to_vm], "toContainer": [d.bdf for d in change.to_container]}
    return split_to, PlanSection("split", "GPU split (VMs / containers)", data, lines,
                                 pending=bool(change.to_vm or change.to_container))
