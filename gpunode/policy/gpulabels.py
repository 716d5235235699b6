"""The node's GPU labels, from sysfs and pci.ids alone: what GPU Feature Discovery and NFD's
NVIDIA rules used to publish, without NVML and without a GPU spent (GPUs on vfio-pci included).

The names and values are GFD's (NVIDIA/k8s-device-plugin ``internal/lm/resource.go``):

- ``nvidia.com/gpu.product``: the GPU's NVML name, sanitised: characters outside
  ``[A-Za-z0-9-_. ]`` dropped, each run of spaces one ``-`` (``NVIDIA H100 80GB HBM3`` ->
  ``NVIDIA-H100-80GB-HBM3``; ``sanitise``);
- ``nvidia.com/gpu.family``: the architecture, from the CUDA compute capability
  (``getArchFamily``: 7.0 volta, 7.5 turing, 8.0/8.6/8.7 ampere, 8.9 ada-lovelace, 9.x
  hopper, 10.x and 12.x blackwell, ...);
- ``nvidia.com/gpu.count``: how many GPUs of that product the node has;
- ``nvidia.com/gpu.memory``: the GPU's memory in MiB as NVML reports it (only where known).

GFD labels one product per node: it makes one labeler per NVML name, each with its own count,
and merges them in Go map order (``internal/lm/mig-strategy.go``, ``newGPULabelers``, which
warns "Multiple device types detected"), so on a node with GPUs of several models the labels
are those of one model, chosen arbitrarily. We choose deterministically: the model with the
most GPUs, a tie going to the model of the first GPU in bus order; ``gpu.count`` is that
model's count, as GFD's is.

``nvidia.com/cc.capable`` is the GPU Operator's NFD rule (``nvidia-nfd-nodefeaturerules``,
``deployments/gpu-operator/templates/nodefeaturerules.yaml`` up to v25.10, removed in v26.3):
``"true"`` on a node with a Hopper (or later: ``gpunode.host.cc.cc_capable``) GPU whose CPU
runs confidential VMs (SEV-SNP or TDX: ``gpunode.host.cc.host_cc``); never ``"false"``. Here
every GPU of the node must be CC-capable (half a node in CC mode serves no confidential VM).

Where a value comes from: ``_KNOWN`` (NVML's name, its memory and the compute capability of
the GPUs named in docs/devices.md, each checked as noted), else NVIDIA's gpu-admin-tools' id
table for the architecture (``gpunode.host.cc.architecture``), else the chip at the front of
the pci.ids name (``GA102GL [A10]``: GA, ampere), and the product from the pci.ids name's
bracket (``NVIDIA A10``); the memory of a GPU not in ``_KNOWN`` is not labelled.

What the agent set is recorded in the state dir (``gpu-labels.json``) so that a revert removes
exactly those labels, and only while they still hold the value it set.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpunode.host import cc
from gpunode.host.files import read_json, remove_file, write_json
from gpunode.host.pci import Device
from gpunode.host.pciids import PciIds

if TYPE_CHECKING:
    from gpunode.host.root import HostRoot
    from gpunode.policy.inventory import Inventory

PRODUCT = "nvidia.com/gpu.product"
FAMILY = "nvidia.com/gpu.family"
COUNT = "nvidia.com/gpu.count"
MEMORY = "nvidia.com/gpu.memory"
CC_CAPABLE = "nvidia.com/cc.capable"
# Every label key the agent may write (the node binding policy allows the agent these).
KEYS: tuple[str, ...] = (PRODUCT, FAMILY, COUNT, MEMORY, CC_CAPABLE)

STATE_FILE = "gpu-labels.json"


@dataclass(frozen=True)
class Known:
    """A GPU as NVML reports it: its name, its memory in MiB (None: not known here) and its
    CUDA compute capability."""

    name: str
    memory_mib: int | None
    compute: tuple[int, int]
    source: str


# (device id, subsystem device id or None for any) -> what NVML says of it. Checked: the H100
# on a device machine (nvidia-smi, driver 580.159, 2026-11-27); the T4 in GFD's README
# (docs/gpu-feature-discovery/README.md: Tesla-T4, 15360, turing); the others from nvidia-smi
# output published with their models. The compute capabilities are NVIDIA's CUDA GPU table.
_KNOWN: dict[tuple[int, int | None], Known] = {
    (0x2330, None): Known("NVIDIA H100 80GB HBM3", 81559, (9, 0), "nvidia-smi on an H100 SXM5 (10de:2330/10de:16c1)"),
    (0x2236, None): Known("NVIDIA A10", 23028, (8, 6), "nvidia-smi on an A10"),
    (0x1EB8, None): Known("Tesla T4", 15360, (7, 5), "GFD's README (Tesla-T4, 15360 MiB, turing)"),
    (0x2230, None): Known("NVIDIA RTX A6000", 49140, (8, 6), "nvidia-smi on an RTX A6000"),
    # NVML names the 10de:2342 boards "NVIDIA GH200 480GB" or "NVIDIA GH200 120GB" (the
    # Grace memory), both with 97871 MiB of HBM3: no name here, so pci.ids names it.
    (0x2342, None): Known("", 97871, (9, 0), "nvidia-smi on GH200 480GB and 120GB boards"),
}

# The chip at the front of a pci.ids name -> GFD's family name.
_CHIP_FAMILY = (("GK", "kepler"), ("GM", "maxwell"), ("GP", "pascal"), ("GV", "volta"), ("TU", "turing"),
                ("GA", "ampere"), ("AD", "ada-lovelace"), ("GH", "hopper"), ("GB", "blackwell"))
_CHIP = re.compile(r"^([A-Z]{2})\d{2,3}")
_BRACKET = re.compile(r"\[([^\]]+)\]")
# GFD's sanitise: drop what is not [A-Za-z0-9-_. ], then join the words with "-".
_NOT_KEPT = re.compile(r"[^A-Za-z0-9\-_. ]")


def sanitise(name: str) -> str:
    """GFD's product rule: ``NVIDIA H100 80GB HBM3`` -> ``NVIDIA-H100-80GB-HBM3``."""
    return "-".join(_NOT_KEPT.sub("", name).split())


def family_of(compute: tuple[int, int]) -> str:
    """GFD's family for a CUDA compute capability (``getArchFamily``)."""
    major, minor = compute
    by_major = {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper",
                10: "blackwell", 12: "blackwell", 13: "rubin"}
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return by_major.get(major, "undefined")


@dataclass(frozen=True)
class GpuFacts:
    """One GPU's facts as labelled, and where each came from."""

    product: str | None
    family: str | None
    memory_mib: int | None
    sources: dict[str, str] = field(default_factory=dict, compare=False)


def gpu_facts(device: Device, pci_ids: PciIds) -> GpuFacts:
    """What the labels say of one NVIDIA GPU, from our table, NVIDIA's tool and pci.ids."""
    ident = device.device if device.device is not None else -1
    known = _KNOWN.get((ident, device.subsystem_device)) or _KNOWN.get((ident, None))
    model = pci_ids.device_name(device.vendor, ident) if device.vendor is not None and ident >= 0 else None
    sources: dict[str, str] = {}
    product = family = None
    if known is not None and known.name:
        product = known.name
        sources[PRODUCT] = f"katamgr's table ({known.source})"
    elif model and (bracket := _BRACKET.search(model)):
        text = bracket.group(1).strip()
        product = text if text.startswith(("NVIDIA", "Tesla ")) else f"NVIDIA {text}"
        sources[PRODUCT] = f"pci.ids ({model!r}); NVML's name may differ"
    if known is not None:
        family = family_of(known.compute)
        sources[FAMILY] = f"katamgr's table (compute capability {known.compute[0]}.{known.compute[1]})"
    elif ident >= 0 and (arch := cc.architecture(ident)) is not None:
        family = arch[0]
        sources[FAMILY] = f"NVIDIA's gpu-admin-tools id table ({arch[1]})"
    elif model and (chip := _CHIP.match(model)):
        family = dict(_CHIP_FAMILY).get(chip.group(1))
        if family:
            sources[FAMILY] = f"pci.ids chip {model.split()[0]}"
    memory = None
    if known is not None and known.memory_mib is not None:
        memory = known.memory_mib
        sources[MEMORY] = f"katamgr's table ({known.source})"
    return GpuFacts(sanitise(product) if product else None, family, memory, sources)


@dataclass(frozen=True)
class NodeGpuLabels:
    """The labels for the node, where each value comes from, and what the operator should
    know (several models, no pci.ids name)."""

    labels: dict[str, str]
    sources: dict[str, str]
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"labels": dict(self.labels), "sources": dict(self.sources), "notes": list(self.notes)}


def node_gpu_labels(host: HostRoot, inventory: Inventory, pci_ids: PciIds) -> NodeGpuLabels:
    """The GPU labels of the node: every NVIDIA GPU in ``inventory`` counts, whatever its
    driver and whatever the device selection says."""
    gpus = [d for d in inventory.devices if d.is_gpu]
    if not gpus:
        return NodeGpuLabels({}, {})
    facts = [gpu_facts(d, pci_ids) for d in gpus]
    keyed = [f.product or d.id_string() for d, f in zip(gpus, facts, strict=True)]
    counts = Counter(keyed)
    # Most GPUs first; a tie goes to the model of the first GPU in bus order.
    chosen = max(counts, key=lambda k: (counts[k], -keyed.index(k)))
    first = facts[keyed.index(chosen)]
    labels: dict[str, str] = {COUNT: str(counts[chosen])}
    sources = {COUNT: "sysfs: the NVIDIA GPUs (PCI class 0300/0302) under /sys/bus/pci/devices"
                      + (" of that product" if len(counts) > 1 else "")}
    if first.product:
        labels[PRODUCT] = first.product
    if first.family:
        labels[FAMILY] = first.family
    if first.memory_mib is not None:
        labels[MEMORY] = str(first.memory_mib)
    sources.update({k: v for k, v in first.sources.items() if k in labels})
    notes: list[str] = []
    if len(counts) > 1:
        notes.append(f"GPUs of {len(counts)} models ({', '.join(sorted(counts))}): labelled as GFD does, with one "
                     f"model's labels, the one with the most GPUs ({chosen}) and its count")
    if all(cc.cc_capable(d) for d in gpus):
        host_cc = cc.host_cc(host)
        if host_cc is not None:
            labels[CC_CAPABLE] = "true"
            sources[CC_CAPABLE] = (f"every GPU is CC-capable (NVIDIA's gpu-admin-tools) and the host's KVM runs "
                                   f"{host_cc} guests")
        else:
            notes.append(f"no {CC_CAPABLE}: the GPUs can run a CC mode but the host's KVM has neither SEV-SNP "
                         f"nor TDX on")
    if PRODUCT not in labels:
        notes.append(f"no {PRODUCT}: {chosen} is neither in katamgr's table nor named in pci.ids")
    return NodeGpuLabels({k: labels[k] for k in KEYS if k in labels}, sources, tuple(notes))


# ---- what the agent set ------------------------------------------------------------


# The labels the agent publishes on its Node and records here: the GPU labels and the Kata
# release found (``katadetect.RELEASE_LABEL``, the same name: not imported, so that this module
# needs no TOML reader); revert removes each one the record lists.
KATA_RELEASE = "katacontainers.io/kata-version"
RECORDED_KEYS: tuple[str, ...] = (*KEYS, KATA_RELEASE)


def recorded(host: HostRoot) -> dict[str, str]:
    """The labels katamgr set on its Node (key -> the value it set)."""
    data = read_json(host.state_path(STATE_FILE), {})
    labels = data.get("labels", {}) if isinstance(data, dict) else {}
    return {k: v for k, v in labels.items() if k in RECORDED_KEYS and isinstance(v, str)}


def record(host: HostRoot, labels: dict[str, str]) -> None:
    if labels:
        write_json(host.state_path(STATE_FILE), {"version": 1, "labels": dict(sorted(labels.items()))})
    else:
        forget(host)


def forget(host: HostRoot) -> None:
    remove_file(host.state_path(STATE_FILE))
