"""The extended resource a passthrough device is advertised under.

Two rules turn a pci.ids model name into the part after ``nvidia.com/``:

- ``nvidia`` (default): NVIDIA's sandbox device plugin, byte for byte, so pod
  specs written for a GPU Operator node keep scheduling here. Upper-case the
  model; ``/`` and ``.`` become ``_``; each run of whitespace becomes ``_``;
  every character outside ``[A-Za-z0-9_-]`` is dropped (``GA107GL [A2 / A16]``
  -> ``GA107GL_A2___A16``). No pci.ids entry: the device id as four lower-case
  hex digits (``22a3``).
- ``compact``: this project's older rule: brackets and parentheses separate
  too, repeated underscores merge, edges are trimmed (``GA107GL_A2_A16``); the
  hex fallback is upper-case.

The result must also be a CDI kind: Kata's cold-plug asks the kubelet which
devices a pod holds and resolves ``<resource name>=<device id>`` in the host's
CDI specs, and the CDI reference parser wants the class to start with a letter
and end with a letter or digit. Where a rule's result is no valid extended
resource name or CDI class, a deterministic variant is used and the reason is
kept for ``katamgr plan``: ``PCI_`` in front of a name that does not start with
a letter (``22a3`` -> ``PCI_22a3``), trailing ``_``/``-`` dropped, and a name
over 63 characters cut to 56 plus ``_`` and six hex digits of the SHA-256 of
the full name, so two long names never merge.

A device an include rule selects (``--include-device 1234:11e8=example.com/edu``,
``gpunode.policy.selection``) is advertised under the rule's name as given; the
rules above name NVIDIA GPUs and NVSwitches only.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from enum import StrEnum
from fnmatch import fnmatchcase

from gpunode.host.pci import Device
from gpunode.host.pciids import PciIds, known_model
from gpunode.k8snames import NVIDIA_CONTAINER_RESOURCES, QUALIFIED_NAME_MAX
from gpunode.policy.selection import (
    DEFAULT_NVSWITCH_RULE,
    DEFAULT_SELECTION,
    NvswitchRule,
    Selection,
    select,
)

RESOURCE_VENDOR = "nvidia.com"
MAX_NAME = QUALIFIED_NAME_MAX  # the part after nvidia.com/ is a qualified name's
VARIANT_PREFIX = "PCI_"
_HASHED_KEEP = 56

_NVIDIA_SLASH_DOT = str.maketrans({"/": "_", ".": "_"})
# Go's RE2 \s: ASCII whitespace only (a no-break space is dropped, not turned into "_").
_GO_WHITESPACE = re.compile(r"[\t\n\f\r ]+")
_DROP = re.compile(r"[^A-Za-z0-9_-]")
# The compact rule: brackets separate too (pci.ids spells some models "GH100[H100 SXM5 80GB]").
_COMPACT_SEPARATORS = re.compile(r"[/.\s\[\]()]+")
_REPEATS = re.compile(r"_+")
_EDGE = re.compile(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$")
_TRAILING = re.compile(r"[^A-Za-z0-9]+$")
# An alias is typed by the operator: never rewritten, so it must already be a
# valid name part and CDI class.
_ALIAS = re.compile(rf"^[A-Za-z]([A-Za-z0-9_-]{{0,{MAX_NAME - 2}}}[A-Za-z0-9])?$")


class ResourceNaming(StrEnum):
    NVIDIA = "nvidia"
    COMPACT = "compact"


@dataclass(frozen=True)
class ResourceName:
    """A resource name and, when it differs from the rule's plain result, why."""

    name: str  # nvidia.com/<suffix>
    rule_result: str  # what the rule alone gives (may be invalid)
    adjustments: tuple[str, ...] = ()


def nvidia_suffix(model: str) -> str:
    """NVIDIA's rule: ``GA107GL [A2 / A16]`` -> ``GA107GL_A2___A16``."""
    text = _go_upper(model).translate(_NVIDIA_SLASH_DOT)
    return _DROP.sub("", _GO_WHITESPACE.sub("_", text))


def _go_upper(text: str) -> str:
    """Go's strings.ToUpper maps rune to rune: "ß" stays "ß" (then dropped), never "SS"."""
    return "".join(up if len(up := c.upper()) == 1 else c for c in text)


def compact_suffix(model: str) -> str:
    """The compact rule: ``GA107GL [A2 / A16]`` -> ``GA107GL_A2_A16``."""
    text = _COMPACT_SEPARATORS.sub("_", model.upper())
    return _EDGE.sub("", _REPEATS.sub("_", _DROP.sub("", text)))


def rule_suffix(rule: ResourceNaming, model: str | None, device: int | None) -> str:
    """What ``rule`` gives for a model name (None: not in pci.ids) and device id."""
    suffix = ""
    if model:
        suffix = nvidia_suffix(model) if rule is ResourceNaming.NVIDIA else compact_suffix(model)
    if suffix:
        return suffix
    if device is None:
        return "UNKNOWN"
    return f"{device:04x}" if rule is ResourceNaming.NVIDIA else f"{device:04X}"


def make_valid(suffix: str) -> tuple[str, tuple[str, ...]]:
    """A valid extended resource name part and CDI class for ``suffix``, and why it changed."""
    why: list[str] = []
    text = suffix
    if not text[:1].isascii() or not text[:1].isalpha():
        text = VARIANT_PREFIX + text
        why.append(f"{suffix!r} does not start with a letter, which a CDI kind needs "
                   f"(Kata resolves the resource name as one), so {VARIANT_PREFIX!r} is put in front")
    trimmed = _TRAILING.sub("", text)
    if trimmed != text:
        why.append(f"{text!r} ends with {text[len(trimmed):]!r}; a resource name ends with a letter or digit")
        text = trimmed
    if len(text) > MAX_NAME:
        digest = hashlib.sha256(suffix.encode()).hexdigest()[:6]
        cut = _TRAILING.sub("", text[:_HASHED_KEEP])
        why.append(f"{text!r} is {len(text)} characters, over the {MAX_NAME} a resource name may have; "
                   f"cut to {len(cut)} and suffixed with a hash of the full name")
        text = f"{cut}_{digest}"
    return text, tuple(why)


def derive_resource_name(
    pci_ids: PciIds, vendor: int | None, device: int | None,
    rule: ResourceNaming = ResourceNaming.NVIDIA, alias: str | None = None,
) -> ResourceName:
    if alias:
        name = f"{RESOURCE_VENDOR}/{alias}"
        return ResourceName(name, name)
    model = pci_ids.device_name(vendor, device) if vendor is not None and device is not None else None
    plain = rule_suffix(rule, model, device)
    valid, why = make_valid(plain)
    return ResourceName(f"{RESOURCE_VENDOR}/{valid}", f"{RESOURCE_VENDOR}/{plain}", why)


def resource_name(
    pci_ids: PciIds, vendor: int | None, device: int | None, alias: str | None = None,
    rule: ResourceNaming = ResourceNaming.NVIDIA,
) -> str:
    """The extended resource a device is advertised under."""
    return derive_resource_name(pci_ids, vendor, device, rule, alias).name


def reserved_alias(alias: str) -> str | None:
    """The container GPU resource (``gpunode.k8snames.NVIDIA_CONTAINER_RESOURCES``) that
    ``nvidia.com/<alias>`` would be, or None. Compared without case, as an include rule's
    name is (``gpunode.policy.selection.resource_problem``)."""
    name = f"{RESOURCE_VENDOR}/{alias}".lower()
    return next((p for p in NVIDIA_CONTAINER_RESOURCES if fnmatchcase(name, p)), None)


def validate_alias(alias: str) -> str:
    """An alias must already be a valid name part: we never rewrite what the operator typed.
    Nor may it be a container GPU's name: the admission layers let a runc container ask for
    nvidia.com/gpu or nvidia.com/mig-*, and the plugin would hand it a VFIO device."""
    if not _ALIAS.match(alias or ""):
        raise ValueError(
            f"alias {alias!r} is not usable as a resource name and CDI kind (letters, digits, '-', '_'; "
            f"start with a letter, end with a letter or digit; at most {MAX_NAME} characters)"
        )
    taken = reserved_alias(alias)
    if taken is not None:
        raise ValueError(
            f"alias {alias!r} would advertise passthrough devices as {RESOURCE_VENDOR}/{alias}, a container "
            f"GPU's name ({taken}, what NVIDIA's container device plugin advertises): the admission "
            f"layers let an ordinary (runc) container ask for it, and it would be handed the raw VFIO "
            f"device; choose another alias (e.g. pgpu), or none for model names"
        )
    return alias


@dataclass(frozen=True)
class Naming:
    """Which devices are advertised and under what extended resource names (the agent
    and the plugin share one: katamgr's CDI specs are named like the plugin's resources).

    ``selection`` (the operator's rules) and ``nvswitch_rule`` (the node's Kata release and
    fabric model, resolved by its context) decide which devices are passthrough devices; they
    travel here because every place that names devices also scans for them
    (``inventory.discover(host, naming.selection, naming.nvswitch_rule)``).
    """

    pci_ids: PciIds
    gpu_alias: str | None = None
    nvswitch_alias: str | None = None
    rule: ResourceNaming = ResourceNaming.NVIDIA
    selection: Selection = DEFAULT_SELECTION
    nvswitch_rule: NvswitchRule = DEFAULT_NVSWITCH_RULE

    def model(self, device: Device) -> str | None:
        """The model name to show (pci.ids', else the one katamgr knows); resource names
        come from pci.ids alone (``derive``), so every node names a resource alike."""
        if device.vendor is None or device.device is None:
            return None
        return self.pci_ids.device_name(device.vendor, device.device) or known_model(device.vendor, device.device)

    def derive(self, device: Device) -> ResourceName | None:
        """The name a passthrough device is advertised under; None for any other device."""
        verdict = select(self.selection, device, self.nvswitch_rule)
        if not verdict.selected:
            return None
        if verdict.resource is not None:
            # An include rule's name is the operator's, already checked: never rewritten.
            return ResourceName(verdict.resource, verdict.resource)
        if device.is_gpu:
            alias = self.gpu_alias
        elif device.is_nvswitch:
            alias = self.nvswitch_alias
        else:
            return None
        return derive_resource_name(self.pci_ids, device.vendor, device.device, self.rule, alias)

    def resource(self, device: Device) -> str | None:
        derived = self.derive(device)
        return derived.name if derived else None
