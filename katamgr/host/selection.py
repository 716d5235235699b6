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

An excluded device is treated like any device that is none of ours: it is never
moved, and an IOMMU group that holds it beside a selected device cannot go to a
VM. This module is pure: ``select`` answers from the rules and the ``Device``
record alone, and every "is this a passthrough device" question
(``katamgr.host.inventory``, ``katamgr.host.naming``) goes through it.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase

import cdi
from katamgr import k8snames
from katamgr.host.pci import BDF_RE, Device

# Where a rule came from, as the plan quotes it ("excluded by --exclude-device 10de:1eb8").
INCLUDE_FLAG = "--include-device"
EXCLUDE_FLAG = "--exclude-device"
INCLUDE_CONFIG = "config devices.include"
EXCLUDE_CONFIG = "config devices.exclude"

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
    """The rules, in the order given (config first, then the command line)."""

    include: tuple[IncludeRule, ...] = ()
    exclude: tuple[ExcludeRule, ...] = ()

    def __post_init__(self) -> None:
        # Two resources for one device would advertise it twice: refuse, naming both.
        seen: dict[Ids, IncludeRule] = {}
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
        return Selection(tuple(include.values()), tuple(exclude.values()))

    @property
    def is_default(self) -> bool:
        return not self.include and not self.exclude


DEFAULT_SELECTION = Selection()


def select(selection: Selection, device: Device) -> Verdict:
    """Whether ``device`` is a passthrough device under ``selection``, and why."""
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
        return Verdict(True, "NVIDIA NVSwitch (default selection)")
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


# ---- the command line ---------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The selection options the agent and the device plugin both take (they must agree)."""
    parser.add_argument(
        INCLUDE_FLAG, action="append", default=[], metavar="VENDOR:DEVICE=RESOURCE",
        help="also pass through every device with these PCI ids, advertised as the extended "
             "resource RESOURCE (domain/name), e.g. 1234:11e8=example.com/edu (repeatable; "
             "by default only NVIDIA GPUs and NVSwitches are passed through)")
    parser.add_argument(
        EXCLUDE_FLAG, action="append", default=[], metavar="BDF|VENDOR:DEVICE",
        help="never pass through this device (full PCI address 0000:01:00.0) or these PCI ids "
             "(10de:1eb8), e.g. a GPU the host's display needs; it stays on its driver, and an "
             "IOMMU group it shares with a selected device is left alone (repeatable; wins over "
             f"{INCLUDE_FLAG})")


def from_arguments(args: argparse.Namespace, base: Selection = DEFAULT_SELECTION) -> Selection:
    """``base`` (the config's rules) with the command line's added; ValueError naming the
    option and the bad value."""
    include = []
    for text in args.include_device or []:
        try:
            include.append(parse_include(text))
        except ValueError as exc:
            raise ValueError(f"{INCLUDE_FLAG}: {exc}") from None
    exclude = []
    for text in args.exclude_device or []:
        try:
            exclude.append(parse_exclude(text))
        except ValueError as exc:
            raise ValueError(f"{EXCLUDE_FLAG}: {exc}") from None
    return base.merged(Selection(tuple(include), tuple(exclude)))

