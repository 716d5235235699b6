"""Which devices to offer a multi-GPU container: GetPreferredAllocation.

GPUs that talk to each other over PCIe (peer-to-peer, GPUDirect) do best under
one PCIe switch, and a VM's memory and vCPUs live on one NUMA node, so a
request for several GPUs should stay on one NUMA node and, inside it, under as
few switches (and root ports) as possible. The policy is a pure function of
the devices' placement, so it is deterministic and testable without a host.

How it picks: the locality levels are NUMA node, root port, PCIe switch. At
each level the candidates are grouped; groups are visited in this order:

1. groups already holding a must-include device (so the rest joins them);
2. without must-include devices, when some groups can hold the whole request,
   the one whose own answer spans the fewest root ports and switches, then the
   smallest (best fit: a 2-GPU request takes a half-used switch, leaving a
   whole free switch for a later 4-GPU request);
3. otherwise groups that fit the remaining need, smallest first, then groups
   that do not, largest first (fewest groups spanned);

ties broken by the group's key, and finally devices are taken in ID order
(IDs are PCI addresses, so that is bus order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from gpunode.host.pci import Device


@dataclass(frozen=True)
class Placement:
    """Where one schedulable device sits in the node's topology."""

    id: str
    numa: int | None = None
    switch: str | None = None  # the PCIe switch's upstream port, else the root port
    root_port: str | None = None


def placement_of(device_id: str, device: Device) -> Placement:
    """A device's placement from its upstream chain (nearest first, root port last).

    Behind a switch the chain is downstream port, switch upstream port, ...,
    root port, so ``parents[1]`` names the switch; a device directly on a root
    port has only the root port, which then stands in for the switch.
    """
    parents = device.parents
    switch = parents[1] if len(parents) >= 2 else (parents[0] if parents else None)
    return Placement(device_id, device.numa_node, switch, device.root_port)


_LEVELS: tuple[Callable[[Placement], object], ...] = (
    lambda p: p.numa,
    lambda p: p.root_port,
    lambda p: p.switch,
)


def _key_order(key: object) -> tuple:
    # None (unknown placement) last; ints numerically, strings as text.
    return (key is None, key if isinstance(key, int) else 0, str(key))


def _spread(picked: list[Placement], level: int) -> tuple[int, ...]:
    """How many groups ``picked`` spans at each level from ``level`` down (lower is more local)."""
    return tuple(len({key_of(p) for p in picked}) for key_of in _LEVELS[level:])


def _fill(
    candidates: list[Placement], need: int, anchors: list[Placement], level: int
) -> list[Placement]:
    if need <= 0 or not candidates:
        return []
    if level == len(_LEVELS):
        return sorted(candidates, key=lambda p: p.id)[:need]
    key_of = _LEVELS[level]
    groups: dict[object, list[Placement]] = {}
    for placement in candidates:
        groups.setdefault(key_of(placement), []).append(placement)

    if not anchors:
        # When one group can hold everything, take the group whose own answer is
        # most local (e.g. the NUMA node with a switch that fits the request),
        # then the smallest such group (best fit), then the first by key.
        options = [
            (_spread(pick, level + 1), len(groups[key]), _key_order(key), pick)
            for key in groups
            if len(groups[key]) >= need
            for pick in [_fill(groups[key], need, [], level + 1)]
        ]
        if options:
            return min(options, key=lambda o: o[:3])[3]

    anchored = {key_of(a) for a in anchors}

    def order(key: object) -> tuple:
        size = len(groups[key])
        fits = size >= need
        return (key not in anchored, not fits, size if fits else -size, _key_order(key))

    chosen: list[Placement] = []
    for key in sorted(groups, key=order):
        if need <= 0:
            break
        inner_anchors = [a for a in anchors if key_of(a) == key]
        taken = _fill(groups[key], min(need, len(groups[key])), inner_anchors, level + 1)
        chosen += taken
        need -= len(taken)
    return chosen


def preferred(
    placements: Sequence[Placement],
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
) -> list[str]:
    """``size`` IDs from ``available`` (all of them if fewer), must-include first.

    ``placements`` describes the devices this resource knows; an available ID
    without one is treated as of unknown placement and offered last.
    """
    chosen = list(dict.fromkeys(must_include))
    if size <= len(chosen):
        return chosen
    known = {p.id: p for p in placements}
    taken = set(chosen)
    candidates = [known.get(i, Placement(i)) for i in dict.fromkeys(available) if i not in taken]
    anchors = [known.get(i, Placement(i)) for i in chosen]
    return chosen + [p.id for p in _fill(candidates, size - len(chosen), anchors, 0)]


def nvswitch_fabric(nvswitch_ids: Iterable[str]) -> str | None:
    """The NVLink fabric of a node's NVSwitches, named by the first one's PCI address;
    None on a node without NVSwitches.

    PCI shows which NVSwitches a node has, not which GPUs their NVLinks reach (that
    is the switches' own topology, which NVIDIA's Fabric Manager reads). On the
    single-baseboard HGX systems (DGX H100: 8 GPUs, 4 NVSwitches) every GPU links to
    every NVSwitch, so the node's GPUs and NVSwitches make one fabric; this names it
    by something of the node that outlives restarts and unit health.
    """
    ids = sorted(nvswitch_ids)
    return f"nvswitch-{ids[0]}" if ids else None
