"""One node, both worlds: which of a node's GPUs are for Kata VMs and which for containers.

A node labeled ``nvidia.com/gpu.workload.config=vm-passthrough`` gives every GPU to VMs. The
split label beside it, ``nvidia.com/gpu.workload.vm-passthrough.gpus`` (GPU-Operator-style: the
workload's name, then what of it), names the VM share; the node's other GPUs stay on the
``nvidia`` driver for ordinary containers (``nvidia.com/gpu``). Its value, a Kubernetes label
value (at most 63 characters of ``[A-Za-z0-9._-]``, so no ``:`` or ``,``), is one of:

- ``N`` (``2``): N GPUs, the last N in bus order, so the container share keeps the indices
  from 0 (what CUDA and ``nvidia-smi`` number first); ``0`` none, ``all`` every GPU;
- ``index.I_J`` (``index.6_7``, ``index.4-7``): the GPUs of those indices, bus order from 0
  as ``nvidia.com/pgpu`` numbers them, ``_`` between items and ``-`` for a range;
- ``pci.B_B`` (``pci.c1-00.0_c2-00.0``, or with the domain ``0000-c1-00.0``): the GPUs at those
  PCI addresses, with ``-`` where the address has ``:``;
- ``model.M`` (``model.2330``, ``model.NVIDIA-H100-80GB-HBM3``): every GPU of that PCI device
  ID or of that product as ``nvidia.com/gpu.product`` names it.

The rules the share keeps (``split``):

- an IOMMU group goes whole (the kernel's group-viability rule: one VM gets every endpoint of
  a group), so two GPUs in one group are on the same side; a count takes groups from the end
  and must come out exact, a selector must name every GPU of a group it names one of;
- NVSwitches go to VMs only with every GPU: NVIDIA's full passthrough model (Fabric Manager
  User Guide §6.1) offers a VM all of a board's GPUs with all its NVSwitches, or one GPU with
  none (its NVLinks disabled in the guest). With a container share the NVSwitches stay on the
  host, where Fabric Manager serves the container GPUs' NVLink fabric (§7);
- a value that names no GPU, a GPU the node does not have, or a group in halves is bad
  configuration (``ConfigError``), naming the value and the fix: nothing moves for it.

``selection_for`` turns a split into katamgr's device selection (the container share and
held-back NVSwitches excluded by PCI address), so the binding and the CDI specs follow it by one
rule (the plugins list from the sides katamgr publishes as it moves GPUs, ``splitnode``);
``moves`` says what a change of split moves, for ``katamgr plan`` and the agent. This module is
pure.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpunode.errors import ConfigError
from gpunode.host.pci import Device
from gpunode.policy.selection import ExcludeRule, Selection

SPLIT_LABEL = "nvidia.com/gpu.workload.vm-passthrough.gpus"
ALL = "all"
SPLIT_ORIGIN = f"the split label {SPLIT_LABEL}"

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_COUNT = re.compile(r"^\d+$")
_INDEX_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")
_PCI_ITEM = re.compile(r"^(?:([0-9a-f]{4})-)?([0-9a-f]{2})-([0-9a-f]{2})\.([0-7])$")
_EXAMPLES = "2, all, index.6_7, index.4-7, pci.c1-00.0_c2-00.0 or model.2330"


@dataclass(frozen=True)
class Split:
    """The node's GPUs in two shares, each in bus order, and the NVSwitches' side."""

    value: str | None  # the label's value; None: no split label (every GPU to VMs)
    vm: tuple[Device, ...]
    container: tuple[Device, ...]
    nvswitches_to_vm: bool
    notes: tuple[str, ...] = ()
    nvswitches: tuple[Device, ...] = ()  # the node's selected NVSwitches, whichever side
    origin: str | None = None  # the node pool whose value it is (``split_value``); None: the label

    @property
    def is_split(self) -> bool:
        return bool(self.container)

    def describe(self) -> str:
        """One line for ``plan`` and ``status``: ``6 for containers, 2 for VMs (...)``."""
        def bdfs(devices: Sequence[Device]) -> str:
            return ", ".join(d.bdf for d in devices) or "none"
        how = (f"no {SPLIT_LABEL} label" if self.value is None else f"{SPLIT_LABEL}={self.value}"
               if self.origin is None else f"{self.origin}: vmGpus {self.value}")
        return (f"{len(self.vm)} for VMs ({bdfs(self.vm)}), {len(self.container)} for containers "
                f"({bdfs(self.container)}): {how}")


class _Bad(Exception):
    """What is wrong with a value; ``split`` names where the value came from and the fix."""


def _bad(value: str, why: str) -> _Bad:
    return _Bad(why)


def refused(value: str, why: str, origin: str | None = None) -> ConfigError:
    """The error for a bad split ``value``, naming where it came from (``origin``: the node pool;
    None: the label) and the fix."""
    if origin is None:
        return ConfigError(f"{SPLIT_LABEL}={value!r} {why}; set it to a count or a selector ({_EXAMPLES}), "
                           "or remove it to give every GPU to VMs")
    return ConfigError(f"{origin}: vmGpus {value!r} {why}; set it to a count or a selector ({_EXAMPLES}), "
                       f"or label the node {SPLIT_LABEL}=VALUE (the label wins over the pool)")


def check_value(value: str) -> None:
    """The value's form, without the node's GPUs (the config parser's check): raises ValueError
    saying what is wrong and the forms it may take."""
    try:
        if len(value) > 63 or not _LABEL_VALUE.match(value):
            raise _bad(value, _NOT_LABEL_VALUE)
        if value.lower() == ALL or _COUNT.match(value):
            return
        kind, _, rest = value.partition(".")
        items = rest.lower().split("_")
        pattern = {"index": _INDEX_ITEM, "pci": _PCI_ITEM, "model": None}.get(kind.lower(), False)
        if pattern is False:
            raise _bad(value, "is neither a count nor a selector index., pci. or model.")
        wrong = [i for i in items if pattern is not None and not pattern.match(i)]
        if not rest or wrong:
            raise _bad(value, f"has the item {(wrong or [''])[0]!r}, which is not "
                              f"{'a number or a range like 4-7' if pattern is _INDEX_ITEM else 'a PCI address like c1-00.0' if pattern is _PCI_ITEM else 'a model'}")
    except _Bad as exc:
        raise ValueError(f"{value!r} {exc}; give a count or a selector ({_EXAMPLES})") from None


_NOT_LABEL_VALUE = ("is not a Kubernetes label value (at most 63 characters of A-Z, a-z, 0-9, "
                    "'-', '_' and '.', starting and ending with a letter or digit)")


def split(gpus: Sequence[Device], value: str | None, *, nvswitches: Sequence[Device] = (),
          products: Mapping[str, str] | None = None, origin: str | None = None) -> Split:
    """The VM and container shares of ``gpus`` (the node's GPUs in bus order) by the split label's
    ``value`` (None or "": no label), or a node pool's (``origin`` names it: ``split_value``).
    ``products``: BDF -> ``nvidia.com/gpu.product`` name."""
    gpus = tuple(sorted(gpus, key=lambda d: d.bdf))
    nvswitches = tuple(nvswitches)
    if value is None or value == "":
        return Split(None, gpus, (), True, nvswitches=nvswitches)
    try:
        if len(value) > 63 or not _LABEL_VALUE.match(value):
            raise _bad(value, _NOT_LABEL_VALUE)
        wanted = _wanted(gpus, value, products or {})
        vm = _whole_groups(gpus, wanted, value)
    except _Bad as exc:
        raise refused(value, str(exc), origin) from None
    container = tuple(d for d in gpus if d not in vm)
    vm_all = not container
    notes = []
    if nvswitches and not vm_all and vm:
        notes.append(f"the NVSwitches ({', '.join(d.bdf for d in nvswitches)}) stay on the host for the "
                     "container GPUs' NVLink fabric: each VM GPU is a one-GPU VM with its NVLinks "
                     "disabled (Fabric Manager User Guide §6.1)")
    return Split(value, vm, container, vm_all, tuple(notes), nvswitches, origin)


@dataclass(frozen=True)
class SplitPool:
    """A node pool's split (the chart's ``sandboxWorkloads.splits``, the config's ``splits``):
    the nodes with all of ``match_labels`` get ``vm_gpus``, a value of the label's syntax,
    where they have no split label (the label wins). ``where``: how the config names it."""

    match_labels: Mapping[str, str]
    vm_gpus: str
    where: str = "splits"

    def describe(self) -> str:
        labels = ",".join(f"{k}={v}" for k, v in sorted(self.match_labels.items()))
        return f"node pool {self.where} (matchLabels {labels or 'none: every node'})"


def split_value(labels: Mapping[str, str], pools: Sequence[SplitPool] = ()) -> tuple[str | None, str | None]:
    """The node's split value and the pool it came from (None: the label, or no split): its
    split label where set, else the first pool whose ``match_labels`` the node has all of."""
    value = labels.get(SPLIT_LABEL) or None
    if value is not None:
        return value, None
    for pool in pools:
        if all(labels.get(k) == v for k, v in pool.match_labels.items()):
            return pool.vm_gpus, pool.describe()
    return None, None


def _wanted(gpus: tuple[Device, ...], value: str, products: Mapping[str, str]) -> tuple[Device, ...]:
    if value.lower() == ALL:
        return gpus
    if _COUNT.match(value):
        count = int(value)
        if count > len(gpus):
            raise _bad(value, f"asks for {count} GPUs but the node has {len(gpus)}")
        return _by_count(gpus, count, value)
    kind, _, rest = value.partition(".")
    kind = kind.lower()
    if kind == "index":
        return _by_index(gpus, rest, value)
    if kind == "pci":
        return _by_pci(gpus, rest, value)
    if kind == "model":
        return _by_model(gpus, rest, value, products)
    raise _bad(value, "is neither a count nor a selector index., pci. or model.")


def _by_count(gpus: tuple[Device, ...], count: int, value: str) -> tuple[Device, ...]:
    """The last ``count`` GPUs in bus order, taken whole IOMMU group by group."""
    taken: list[Device] = []
    for group in reversed(_groups(gpus)):
        if len(taken) >= count:
            break
        taken.extend(group)
    if len(taken) != count:
        raise _bad(value, f"cannot be met in whole IOMMU groups: the last groups hold {len(taken)} GPUs "
                          f"({', '.join(sorted(d.bdf for d in taken))}), and a group goes to one side whole")
    return tuple(taken)


def _by_index(gpus: tuple[Device, ...], rest: str, value: str) -> tuple[Device, ...]:
    picked: set[int] = set()
    for item in rest.split("_"):
        match = _INDEX_ITEM.match(item)
        if not match:
            raise _bad(value, f"has index item {item!r}, which is not a number or a range like 4-7")
        first, last = int(match[1]), int(match[2] if match[2] is not None else match[1])
        if last < first:
            raise _bad(value, f"has the range {item!r}, which runs backwards")
        if last >= len(gpus):
            raise _bad(value, f"names index {last}, but the node's GPUs are indices 0 to {len(gpus) - 1}")
        picked.update(range(first, last + 1))
    return tuple(gpus[i] for i in sorted(picked))


def _by_pci(gpus: tuple[Device, ...], rest: str, value: str) -> tuple[Device, ...]:
    by_bdf = {d.bdf: d for d in gpus}
    picked = []
    for item in rest.lower().split("_"):
        match = _PCI_ITEM.match(item)
        if not match:
            raise _bad(value, f"has PCI address {item!r}, which is not BUS-DEVICE.FUNCTION like c1-00.0 "
                              "(or DOMAIN-BUS-DEVICE.FUNCTION like 0000-c1-00.0)")
        bdf = f"{match[1] or '0000'}:{match[2]}:{match[3]}.{match[4]}"
        if bdf not in by_bdf:
            raise _bad(value, f"names {bdf}, which is not one of the node's GPUs "
                              f"({', '.join(by_bdf) or 'none'})")
        picked.append(by_bdf[bdf])
    return tuple(picked)


def _by_model(gpus: tuple[Device, ...], rest: str, value: str, products: Mapping[str, str]) -> tuple[Device, ...]:
    want = rest.lower()
    picked = tuple(d for d in gpus
                   if (d.device is not None and f"{d.device:04x}" == want)
                   or products.get(d.bdf, "").lower() == want)
    if not picked:
        known = sorted({f"{d.device:04x}" for d in gpus if d.device is not None} | set(products.values()))
        raise _bad(value, f"names model {rest!r}, which none of the node's GPUs is "
                          f"(its models: {', '.join(known) or 'none'})")
    return picked


def _groups(gpus: tuple[Device, ...]) -> list[tuple[Device, ...]]:
    """The GPUs by IOMMU group, groups in bus order (a GPU with no group is its own)."""
    groups: dict[object, list[Device]] = {}
    for d in gpus:
        groups.setdefault(d.iommu_group if d.iommu_group is not None else d.bdf, []).append(d)
    return [tuple(members) for members in groups.values()]


def _whole_groups(gpus: tuple[Device, ...], wanted: tuple[Device, ...], value: str) -> tuple[Device, ...]:
    chosen = {d.bdf for d in wanted}
    for group in _groups(gpus):
        inside = [d.bdf for d in group if d.bdf in chosen]
        if inside and len(inside) != len(group):
            outside = [d.bdf for d in group if d.bdf not in chosen]
            raise _bad(value, f"splits IOMMU group {group[0].iommu_group}: it names {', '.join(inside)} but "
                              f"not {', '.join(outside)}, and a group goes to one side whole (name both)")
    return tuple(d for d in gpus if d.bdf in chosen)


def selection_for(selection: Selection, share: Split) -> Selection:
    """``selection`` with the container share (and the NVSwitches it keeps on the host) excluded by
    PCI address: the agent binds, the plugin advertises and the CDI specs name only the VM share."""
    if not share.is_split:
        return selection
    keep = [*share.container, *(() if share.nvswitches_to_vm else share.nvswitches)]
    known = {rule.bdf for rule in selection.exclude}
    rules = tuple(ExcludeRule(bdf=d.bdf, origin=SPLIT_ORIGIN) for d in keep if d.bdf not in known)
    return dataclasses.replace(selection, exclude=(*selection.exclude, *rules))


@dataclass(frozen=True)
class Moves:
    """What a change of split moves: GPUs to VMs (bound to vfio-pci once free) and to containers."""

    to_vm: tuple[Device, ...]
    to_container: tuple[Device, ...]

    def describe(self) -> str:
        parts = []
        if self.to_vm:
            parts.append(f"to VMs: {', '.join(d.bdf for d in self.to_vm)}")
        if self.to_container:
            parts.append(f"to containers: {', '.join(d.bdf for d in self.to_container)}")
        return "; ".join(parts) or "nothing moves"


def moves(old: Split, new: Split) -> Moves:
    """The GPUs that change side from ``old`` to ``new``, in bus order."""
    was_vm = {d.bdf for d in old.vm}
    now_vm = {d.bdf for d in new.vm}
    every = {d.bdf: d for d in (*old.vm, *old.container, *new.vm, *new.container)}
    return Moves(tuple(every[b] for b in sorted(now_vm - was_vm)),
                 tuple(every[b] for b in sorted(was_vm - now_vm)))


def dra_refusal(value: str, origin: str | None = None) -> str:
    """Why a split is refused on a node whose passthrough GPUs the DRA driver serves: katamgr waits
    for the kubelet's device plugins only, not for the DRA driver's ResourceSlice to be
    republished, before it gives a leaving GPU back (nothing is moved for it)."""
    where = f"{origin}: vmGpus" if origin else SPLIT_LABEL
    return (f"{where}={value!r} splits a node whose passthrough GPUs the DRA driver serves "
            "(podResourceDeviceSources lists dra: the chart's dra.enabled), where a claim could be given "
            f"a GPU on its way to containers; remove the {'pool' if origin else 'label'}, or serve the "
            "node with the device plugins (dra.enabled=false)")
