"""The plan's NVLink fabric section: which of NVIDIA's models the node follows and why, and in
the Shared NVSwitch model the partitions Fabric Manager offers (id, size, GPUs) and which are
active (``gpunode.services.nvlinkfabric``; Fabric Manager User Guide §4, §6, §7). Read-only:
``plan`` asks FM, it never activates anything."""

from __future__ import annotations

from gpunode.policy import nvlinkunits
from gpunode.services import nvlinkfabric as nf
from katamgr.pipeline.plan import Plan, PlanSection


def add_section(host, plan: Plan, settings: nf.FabricSettings, naming=None) -> None:
    """The section, and a problem where neither model holds on an NVSwitch board."""
    inv = plan.inventory
    nvswitches = sum(1 for d in inv.devices if d.is_nvswitch)  # on the board, passed through or not
    if nvswitches == 0:
        return
    gpus = sorted(d.bdf for d in inv.passthrough if d.is_gpu)
    kata = inv.nvswitch_rule.kata
    choice, fabric = nf.decide(host, settings, nvswitches=nvswitches, gpus=gpus,
                               kata_takes_nvswitches=kata.cold_plugs_nvswitches, kata=str(kata))
    lines = [f"model: {nf.MODEL_TITLES.get(choice.model, 'none')}", f"why: {choice.reason}"]
    data: dict = {"model": choice.model, "why": choice.reason, "configured": settings.model}
    if choice.model == nf.SHARED and fabric is not None:
        lines.append(f"Fabric Manager: {settings.address}; a Kata pod takes {fabric.sizes_text()} GPUs")
        lines += [p.line() for p in fabric.partitions]
        lines += [f"note: {u}" for u in fabric.unplaced]
        data["partitions"] = [{"id": p.partition_id, "size": p.size, "gpus": list(p.gpus), "active": p.active,
                               "moduleIds": list(p.physical_ids)} for p in fabric.partitions]
    board = nvlinkunits.board_of(inv, once_bound=True) if choice.model == nf.FULL else None
    if board is not None:
        gpu_resource = naming.resource(board.gpus[0]) if naming is not None else None
        unit = nvlinkunits.unit_resource(gpu_resource, board.size) if gpu_resource else None
        lines.append(f"units ({board.model.name}, {nvlinkunits.GUIDE}): a Kata pod takes {board.sizes_text()} GPUs")
        lines += board.lines(gpu_resource, unit)
        data["units"] = [{"gpus": c.gpus, "nvswitches": c.nvswitches, "offered": c.offered,
                          "resource": (unit if c.gpus == board.size else gpu_resource) if c.offered else None}
                         for c in board.model.configurations]
    elif choice.model == nf.FULL:
        lines.append(f"units: no VM configuration of {nvlinkunits.GUIDE} fits the GPUs and NVSwitches passed "
                     "through here (a board's 8 GPUs with all of its NVSwitches)")
    if choice.model is None:
        # The device plugin and the DRA driver advertise none of the board's GPUs while neither
        # model holds (sandbox_plugin.fabricgate): the plan promises none either.
        withheld = sorted({d.resource for d in plan.devices if d.bdf in gpus and d.resource in plan.resources})
        for name in withheld:
            del plan.resources[name]
        data["withheld"] = withheld
        if withheld:
            lines.append(f"withheld: {', '.join(withheld)} (none of this board's GPUs is advertised for Kata "
                         "until a model holds)")
    if choice.problem:
        plan.problems.append(choice.problem)
    plan.sections.append(PlanSection("nvlink_fabric", "NVLink fabric (NVSwitch board)", data, lines))
