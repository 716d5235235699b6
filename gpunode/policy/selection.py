"""Device selection: which PCI devices are passthrough devices, and why.

By default the passthrough devices are NVIDIA GPUs and NVSwitches. An operator
changes that with two kinds of rule, from the command line
(``--include-device``, ``--exclude-device``) or the config file (``devices``):

- an *include* rule ``VENDOR:DEVICE=RESOURCE`` makes every device with those
  PCI ids a passthrough device advertised as the extended resource
  ``RESOURCE`` (QEMU's ``edu`` stand-in, ``1234:11e8=example.com/edu``);
- an *exclude* rule, a full BDF (``0000:01:00.0``) or ``VENDOR:DEVICE``, keeps a
  device on its driver (the display GPU of a workstation). Exclusion wins over
  inclusion and over the default.

NVSwitches are passthrough devices only where the node's Kata can cold-plug them: Kata
before 4.1 takes an NVSwitch (class 0x0680) for a bridge and fails every sandbox given one
("unsupported device type", ``gpunode.policy.kata``). ``--nvswitches auto`` (the default) passes
them through when ``--kata-version`` names 4.1 or later, ``true`` always (the operator's call,
with a warning where Kata will fail), ``false`` never: the chart's and the config's
``devices.nvswitches`` spelling (the options live in ``gpunode.services.options``). Where the
node's NVLink fabric model keeps them on the host (NVIDIA's Shared NVSwitch model: Fabric Manager
on the host sets the GPUs' partitions up with them, Fabric Manager User Guide §7), ``auto`` keeps
them there whatever Kata takes, and ``true`` is a plan problem: it would take them from Fabric
Manager. The Kata release and the fabric model are the node's, not the operator's rules: the
node's context resolves them once into an ``NvswitchRule``, which ``select`` takes beside the
``Selection``.

An excluded device is treated like any device that is none of ours: it is never
moved, and an IOMMU group that holds it beside a selected device cannot go to a
VM. This module is pure: ``select`` answers from the rules, the ``NvswitchRule`` and the
``Device`` record alone, and every "is this a passthrough device" question
(``gpunode.policy.inventory``, ``gpunode.policy.naming``) goes through it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal

import cdi
from gpunode import k8snames
from gpunode.host.pci import BDF_RE, Device
from gpunode.policy.katarelease import UNKNOWN, KataRelease

# Where a rule came from, as the plan quotes it ("excluded by --exclude-device 10de:1eb8").
INCLUDE_FLAG = "--include-device"
EXCLUDE_FLAG = "--exclude-device"
NVSWITCHES_FLAG = "--nvswitches"
KATA_VERSION_FLAG = "--kata-version"
INCLUDE_CONFIG = "config devices.include"
EXCLUDE_CONFIG = "config devices.exclude"

# Why ``--nvswitches auto`` leaves NVSwitches on their driver in the Shared NVSwitch model.
FABRIC_KEEPS = "kept on the host for NVIDIA Fabric Manager (Shared NVSwitch model, Fabric Manager User Guide §7)"

_IDS = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{4}$")

# The same rules as JSON Schema patterns (the config's and the chart's schema), case-insensitive
# as the parsers are. A resource's domain and name start with a letter: a CDI vendor and class
# must, and Kata resolves the resource name as a CDI kind. The functions below stay the
# authority (the domain's length, the kubernetes.io namespace).
IDS_PATTERN = r"^[0-9A-Fa-f]{4}:[0-9A-Fa-f]{4}$"
EXCLUDE_PATTERN = r"^([0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]|[0-9A-Fa-f]{4}:[0-9A-Fa-f]{4})$"
RESOURCE_PATTERN = (r"^[a-z]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
                    r"/[A-Za-z]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
# Looks like a BDF someone shortened (01:00.0): worth a pointed hint.
_SHORT_BDF = re.compile(r"^[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


@dataclass(frozen=True)
class Ids:
    """A PCI vendor and device id pair, printed as ``1234:11e8``."""

    vendor: int
    device: int

    def __str__(self) -> str:
        return f"{self.vendor:04x}:{self.device:04x}"

    def matches(self, device: Device) -> bool:
        return (device.vendor, device.device) == (self.vendor, self.device)


@dataclass(frozen=True)
class IncludeRule:
    ids: Ids
    resource: str  # a full extended resource name, also the CDI kind of its spec
    origin: str = INCLUDE_FLAG

    def __str__(self) -> str:
        return f"{self.ids}={self.resource}"


@dataclass(frozen=True)
class ExcludeRule:
    """One of ``bdf`` or ``ids`` is set."""

    bdf: str | None = None
    ids: Ids | None = None
    origin: str = EXCLUDE_FLAG

    @property
    def value(self) -> str:
        return self.bdf if self.bdf is not None else str(self.ids)

    def matches(self, device: Device) -> bool:
        if self.bdf is not None:
            return device.bdf == self.bdf
        return self.ids is not None and self.ids.matches(device)


@dataclass(frozen=True)
class Verdict:
    """Whether a device is a passthrough device, and why, in words for the plan."""

    selected: bool
    why: str
    resource: str | None = None  # the include rule's resource name
    excluded: bool = False  # an exclude rule names it


@dataclass(frozen=True)
class Selection:
    """The operator's rules, in the order given (config first, then the command line), and
    their NVSwitch setting (``nvswitches``); what the node's Kata and NVLink fabric add to the
    NVSwitch decision is the node's context's, an ``NvswitchRule``."""

    include: tuple[IncludeRule, ...] = ()
    exclude: tuple[ExcludeRule, ...] = ()
    # The chart's and the config's devices.nvswitches as they write it: auto, true or false.
    nvswitches: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        # Two resources for one device would advertise it twice: refuse, naming both.
        seen: dict[Ids, IncludeRule] = {}
        if not (self.nvswitches is True or self.nvswitches is False or self.nvswitches == "auto"):
            raise ValueError(f"nvswitches {self.nvswitches!r} is not one of auto, true, false")
        for rule in self.include:
            first = seen.setdefault(rule.ids, rule)
            if first.resource != rule.resource:
                raise ValueError(
                    f"{rule.origin} {rule} and {first.origin} {first} include {rule.ids} under two "
                    "resource names; a device is advertised under one")

    def merged(self, other: Selection) -> Selection:
        """These rules, then ``other``'s; a rule repeated from either source is kept once
        (the first, so the plan quotes where it was first given)."""
        include: dict[str, IncludeRule] = {}
        for rule in (*self.include, *other.include):
            include.setdefault(str(rule), rule)
        exclude: dict[str, ExcludeRule] = {}
        for rule in (*self.exclude, *other.exclude):
            exclude.setdefault(rule.value, rule)
        return Selection(tuple(include.values()), tuple(exclude.values()), self.nvswitches)

    @property
    def is_default(self) -> bool:
        return not self.include and not self.exclude


@dataclass(frozen=True)
class NvswitchRule:
    """The two inputs of the NVSwitch rule besides the operator's ``nvswitches`` setting, resolved
    once per node by its context (``gpunode.services.nodecontext``): the Kata release that decides
    (typed, or found on the node), and whether the node's NVLink fabric model keeps NVSwitches on
    the host for Fabric Manager (Shared NVSwitch model, ``nvlinkfabric.keeps_nvswitches``)."""

    kata: KataRelease = UNKNOWN
    fabric_keeps_nvswitches: bool = False

    def takes_nvswitches(self, nvswitches: bool | Literal["auto"]) -> bool:
        """Whether the default selection passes NVSwitches through under the setting ``nvswitches``."""
        if nvswitches == "auto":
            return self.kata.cold_plugs_nvswitches and not self.fabric_keeps_nvswitches
        return nvswitches is True

    def nvswitch_why_not(self, nvswitches: bool | Literal["auto"]) -> str:
        """Why NVSwitches are not passed through (the plan's and the docs' words)."""
        if nvswitches is False:
            return f"NVIDIA NVSwitch, not passed through ({NVSWITCHES_FLAG} false)"
        if self.fabric_keeps_nvswitches:
            return f"NVIDIA NVSwitch, {FABRIC_KEEPS}"
        if self.kata.version is None:
            return ("NVIDIA NVSwitch, not passed through: Kata before 4.1 cannot cold-plug one, and "
                    f"{KATA_VERSION_FLAG} does not say the node runs a later release")
        return f"NVIDIA NVSwitch, not passed through: {self.kata} cannot cold-plug one"

    @property
    def nvswitch_held_back(self) -> str:
        """The plan's and the Event's sentence for NVSwitches ``--nvswitches auto`` keeps on the host."""
        if self.fabric_keeps_nvswitches:
            return f"{FABRIC_KEEPS}, which sets the GPUs' NVLink partitions up with them"
        return (f"{nvswitch_failure(self.kata)}. {NVSWITCHES_FLAG} true (chart: devices.nvswitches) passes "
                "them through all the same")

    def nvswitch_warning(self, nvswitches: bool | Literal["auto"]) -> str | None:
        """What the operator is told when NVSwitches are passed through to a Kata that fails them."""
        if nvswitches is not True or self.kata.cold_plugs_nvswitches:
            return None
        return (f"NVSwitches are passed through ({NVSWITCHES_FLAG} true), but {nvswitch_failure(self.kata)}: "
                "a pod given an NVSwitch will not start until the node runs Kata 4.1 or later")

    def nvswitch_fabric_conflict(self, nvswitches: bool | Literal["auto"]) -> str | None:
        """The plan problem where NVSwitches are passed through but the fabric model keeps them on
        the host: bound to vfio-pci they are gone from Fabric Manager, and no partition comes up."""
        if nvswitches is not True or not self.fabric_keeps_nvswitches:
            return None
        return (f"{NVSWITCHES_FLAG} true (chart: devices.nvswitches) passes the NVSwitches through, but the "
                "node's NVLink fabric model (--nvlink-fabric, chart: devices.nvlinkFabric) is Shared NVSwitch, where "
                "they stay on the host with Fabric Manager (Fabric Manager User Guide §7): bound to vfio-pci they "
                "are taken from it and no GPU partition can be activated; set --nvswitches auto (or false), or "
                "--nvlink-fabric fullPassthrough to pass them through with the GPUs and run FM in the guest (§6)")


def nvswitch_failure(kata: KataRelease) -> str:
    if kata.version is None:
        return ("the node's Kata release is unknown (" + KATA_VERSION_FLAG + "), and Kata before 4.1 "
                "takes an NVSwitch for a bridge and fails every sandbox given one (\"unsupported device type\")")
    return (f"{kata} takes an NVSwitch (class 0x0680) for a bridge and fails every sandbox given one "
            "(\"unsupported device type\"; fixed in Kata 4.1)")


DEFAULT_SELECTION = Selection()
# A node whose Kata release is unknown and whose fabric model keeps no NVSwitch on the host.
DEFAULT_NVSWITCH_RULE = NvswitchRule()


def select(selection: Selection, device: Device, nvswitch_rule: NvswitchRule = DEFAULT_NVSWITCH_RULE) -> Verdict:
    """Whether ``device`` is a passthrough device under ``selection``, and why; an NVSwitch by
    the setting ``selection.nvswitches`` and the node's ``nvswitch_rule``."""
    for rule in selection.exclude:
        if rule.matches(device):
            return Verdict(False, f"excluded by {rule.origin} {rule.value}", excluded=True)
    for rule in selection.include:
        if rule.ids.matches(device):
            return Verdict(True, f"included by {rule.origin} {rule.ids} as {rule.resource}",
                           resource=rule.resource)
    if device.is_gpu:
        return Verdict(True, "NVIDIA GPU (default selection)")
    if device.is_nvswitch:
        if not nvswitch_rule.takes_nvswitches(selection.nvswitches):
            return Verdict(False, nvswitch_rule.nvswitch_why_not(selection.nvswitches))
        if selection.nvswitches is True:
            return Verdict(True, f"NVIDIA NVSwitch ({NVSWITCHES_FLAG} true)")
        return Verdict(True, f"NVIDIA NVSwitch ({nvswitch_rule.kata} cold-plugs NVSwitches)")
    return Verdict(False, "not an NVIDIA GPU, NVSwitch or included device")


# ---- parsing: one set of rules for the flags and the config file -----------------------


def ids_problem(text: str) -> str | None:
    """Why ``text`` is not ``VENDOR:DEVICE`` (4 hex digits each), or None."""
    if isinstance(text, str) and _IDS.match(text.lower()):
        return None
    return "is not a PCI vendor:device pair (4 hex digits each, e.g. 10de:1eb8)"


def bdf_problem(text: str) -> str | None:
    """Why ``text`` is not a full PCI address, or None."""
    value = text.lower()
    if BDF_RE.match(value):
        return None
    hint = f" (with its domain: 0000:{value})" if _SHORT_BDF.match(value) else ""
    return f"is not a full PCI address such as 0000:01:00.0{hint}"


def exclude_problem(text: str) -> str | None:
    """Why ``text`` is neither a full PCI address nor ``VENDOR:DEVICE``, or None."""
    if not isinstance(text, str):
        return "is not a PCI address (0000:01:00.0) or vendor:device pair (10de:1eb8)"
    if text.count(":") == 1 and "." not in text:
        return ids_problem(text)
    if "." in text or text.count(":") > 1:  # meant as a PCI address
        return bdf_problem(text)
    return "is neither a full PCI address (0000:01:00.0) nor a vendor:device pair (10de:1eb8)"


# Names an include rule may not take: a container's GPUs would then be VFIO
# devices (and the webhook lets a container have those), or the CDI kinds
# katamgr's own specs and nvidia-ctk's define would clash.
RESERVED_RESOURCES = {
    **{p: "NVIDIA's container device plugin advertises it" for p in k8snames.NVIDIA_CONTAINER_RESOURCES},
    "nvidia.com/pgpu": "the CDI kind of katamgr's GPU index names",
    "nvidia.com/nvswitch": "the CDI kind of katamgr's NVSwitch index names",
}


def resource_problem(resource: str) -> str | None:
    """Why ``resource`` cannot be an included device's resource name, or None."""
    if not k8snames.is_extended_resource_name(resource):
        return ("is not an extended resource name (domain/name, e.g. example.com/edu; "
                "not in the kubernetes.io domain)")
    try:
        cdi.parse_kind(resource)
    except cdi.InvalidNameError as exc:
        # Kata resolves the resource name as a CDI kind (katamgr writes one spec per resource).
        return f"is not usable as a CDI kind, which Kata resolves a resource name as: {exc}"
    taken = next((p for p in RESERVED_RESOURCES if fnmatchcase(resource.lower(), p)), None)
    if taken is not None:
        return (f"is taken ({taken}: {RESERVED_RESOURCES[taken]}); name the device's own resource, "
                "e.g. example.com/edu")
    return None


def _checked(text: str, problem: str | None) -> str:
    if problem:
        raise ValueError(f"{text!r} {problem}")
    return text.lower()


def parse_ids(text: str) -> Ids:
    """``10DE:1EB8`` -> Ids(0x10de, 0x1eb8); ValueError naming the value otherwise."""
    vendor, device = _checked(text, ids_problem(text)).split(":")
    return Ids(int(vendor, 16), int(device, 16))


def parse_include(text: str, origin: str = INCLUDE_FLAG) -> IncludeRule:
    """``VENDOR:DEVICE=RESOURCE``; ValueError naming the value otherwise."""
    ids, sep, resource = text.partition("=")
    if not sep or not resource:
        raise ValueError(f"{text!r} is not VENDOR:DEVICE=RESOURCE (e.g. 1234:11e8=example.com/edu)")
    return include_rule(ids, resource, origin)


def include_rule(ids: str, resource: str, origin: str = INCLUDE_CONFIG) -> IncludeRule:
    parsed = parse_ids(ids)
    if problem := resource_problem(resource):
        raise ValueError(f"{resource!r} {problem}")
    return IncludeRule(parsed, resource, origin)


def parse_exclude(text: str, origin: str = EXCLUDE_FLAG) -> ExcludeRule:
    """A full BDF or ``VENDOR:DEVICE``; ValueError naming the value otherwise."""
    value = _checked(text, exclude_problem(text))
    if BDF_RE.match(value):
        return ExcludeRule(bdf=value, origin=origin)
    return ExcludeRule(ids=parse_ids(value), origin=origin)
