"""CDI spec versions and the minimum version a spec's fields need.

Facts from the CDI specification's version history (and its reference implementation):

======  ===========================================================================
0.3.0   earliest version with today's document shape
0.4.0   ``mounts[].type``
0.5.0   ``deviceNodes[].hostPath``; device names may start with a digit
0.6.0   ``annotations`` on the spec and on devices; ``.`` in the kind's class
0.7.0   ``intelRdt``; ``additionalGids``
0.8.0   no document change (API-only release)
1.0.0   no document change
1.1.0   ``netDevices``; ``intelRdt.schemata`` and ``intelRdt.enableMonitoring``, which
        replace ``intelRdt.enableCMT``/``enableMBM`` (those are invalid from 1.1.0 on)
======  ===========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

from cdi.model import ContainerEdits, Spec

KNOWN_VERSIONS: tuple[str, ...] = (
    "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0",
)
EARLIEST_VERSION = KNOWN_VERSIONS[0]
LATEST_VERSION = KNOWN_VERSIONS[-1]
# enableCMT/enableMBM were replaced in this version.
INTEL_RDT_MONITORING_VERSION = "1.1.0"


def normalize_version(version: str) -> str:
    """``"v0.5.0"`` -> ``"0.5.0"`` (the reference accepts a leading ``v``)."""
    return version[1:] if version.startswith("v") else version


def is_known_version(version: str) -> bool:
    return normalize_version(version) in KNOWN_VERSIONS


def version_key(version: str) -> tuple[int, ...]:
    """Sortable key of a dotted version (``"0.10.0"`` sorts after ``"0.9.0"``)."""
    try:
        return tuple(int(p) for p in normalize_version(version).split("."))
    except ValueError:
        raise ValueError(f"CDI version {version!r} is not of the form X.Y.Z") from None


@dataclass(frozen=True)
class Requirement:
    """``field`` (a JSON path) needs at least cdiVersion ``version`` because ``reason``."""

    version: str
    field: str
    reason: str


def _edits_requirements(edits: ContainerEdits, path: str) -> list[Requirement]:
    found = []
    for i, mount in enumerate(edits.mounts):
        if mount.type:
            found.append(Requirement("0.4.0", f"{path}.mounts[{i}].type", "mount type"))
    for i, node in enumerate(edits.device_nodes):
        if node.host_path:
            found.append(Requirement("0.5.0", f"{path}.deviceNodes[{i}].hostPath",
                                     "device node hostPath"))
    if edits.intel_rdt is not None:
        found.append(Requirement("0.7.0", f"{path}.intelRdt", "intelRdt"))
        if edits.intel_rdt.schemata is not None:
            found.append(Requirement("1.1.0", f"{path}.intelRdt.schemata", "intelRdt.schemata"))
        if edits.intel_rdt.enable_monitoring is not None:
            found.append(Requirement("1.1.0", f"{path}.intelRdt.enableMonitoring",
                                     "intelRdt.enableMonitoring"))
    if edits.additional_gids:
        found.append(Requirement("0.7.0", f"{path}.additionalGids", "additionalGids"))
    if edits.net_devices:
        found.append(Requirement("1.1.0", f"{path}.netDevices", "netDevices"))
    return found


def requirements(spec: Spec) -> list[Requirement]:
    """Every field of ``spec`` that needs more than the earliest version, in document order."""
    found = []
    if "." in spec.kind.partition("/")[2]:
        found.append(Requirement("0.6.0", "kind", "a '.' in the class"))
    if spec.annotations:
        found.append(Requirement("0.6.0", "annotations", "spec annotations"))
    for i, device in enumerate(spec.devices):
        path = f"devices[{i}]"
        if device.name[:1].isdigit() and device.name[:1].isascii():
            found.append(Requirement("0.5.0", f"{path}.name",
                                     "a device name starting with a digit"))
        if device.annotations:
            found.append(Requirement("0.6.0", f"{path}.annotations", "device annotations"))
        found.extend(_edits_requirements(device.container_edits, f"{path}.containerEdits"))
    found.extend(_edits_requirements(spec.container_edits, "containerEdits"))
    return found


def minimum_version(spec: Spec) -> str:
    """The lowest cdiVersion that has every field ``spec`` uses (at least 0.3.0)."""
    return max((r.version for r in requirements(spec)), key=version_key,
               default=EARLIEST_VERSION)
