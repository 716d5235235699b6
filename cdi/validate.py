"""CDI rules a spec must follow beyond its structure.

``spec_problems`` lists every problem as a SpecError naming the field path;
``validate_spec`` raises InvalidSpecError carrying them all. The rules are the CDI
specification's (as enforced by its reference implementation): kind and device names,
unique non-empty devices, Kubernetes annotation keys, device node / hook / mount
fields, integer ranges, and a ``cdiVersion`` that is known and new enough for every
field used (see ``cdi.version``).
"""

from __future__ import annotations

from collections.abc import Mapping

from cdi.errors import InvalidNameError, InvalidSpecError, SpecError
from cdi.model import ContainerEdits, Spec
from cdi.names import annotations_problems, parse_kind, validate_device_name
from cdi.version import (
    EARLIEST_VERSION,
    INTEL_RDT_MONITORING_VERSION,
    KNOWN_VERSIONS,
    is_known_version,
    normalize_version,
    requirements,
    version_key,
)

HOOK_NAMES = frozenset(
    {"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"})
DEVICE_TYPES = frozenset({"b", "c", "u", "p"})
UINT32_MAX = 2**32 - 1
INT64_MAX = 2**63 - 1
_CLOS_ID_MAX = 4096


def _range(problems: list[SpecError], path: str, value: int | None, low: int, high: int,
           what: str) -> None:
    if value is not None and not low <= value <= high:
        problems.append(SpecError(path, f"{value} is out of range for {what} ({low}..{high})"))


def _env(problems: list[SpecError], path: str, env: list[str]) -> None:
    for i, entry in enumerate(env):
        if entry.find("=") <= 0:
            problems.append(SpecError(f"{path}[{i}]",
                                      f"{entry!r} is not an environment entry NAME=value"))


def _annotations(problems: list[SpecError], path: str, annotations: Mapping[str, str]) -> None:
    for key, problem in annotations_problems(annotations):
        problems.append(SpecError(f"{path}.{key}" if key else path, problem))


def edits_problems(edits: ContainerEdits, path: str) -> list[SpecError]:
    """Problems of one ``containerEdits`` block found at JSON path ``path``."""
    problems: list[SpecError] = []
    _env(problems, f"{path}.env", edits.env)
    for i, node in enumerate(edits.device_nodes):
        where = f"{path}.deviceNodes[{i}]"
        if not node.path:
            problems.append(SpecError(f"{where}.path", "is empty; a device node needs a path"))
        if node.type and node.type not in DEVICE_TYPES:
            problems.append(SpecError(f"{where}.type", f"{node.type!r} is not a device type "
                                                       "(b, c, u or p)"))
        # Negative numbers would be wildcards to the runtime, hence refused.
        _range(problems, f"{where}.major", node.major, 0, INT64_MAX, "a device major")
        _range(problems, f"{where}.minor", node.minor, 0, INT64_MAX, "a device minor")
        _range(problems, f"{where}.fileMode", node.file_mode, 0, UINT32_MAX, "a file mode")
        _range(problems, f"{where}.uid", node.uid, 0, UINT32_MAX, "a uid")
        _range(problems, f"{where}.gid", node.gid, 0, UINT32_MAX, "a gid")
        perms = node.permissions
        if perms and perms != "none" and perms.strip("rwm"):
            problems.append(SpecError(f"{where}.permissions", f"{perms!r} must be a combination "
                                                              "of r, w and m (or 'none')"))
    for i, hook in enumerate(edits.hooks):
        where = f"{path}.hooks[{i}]"
        if hook.hook_name not in HOOK_NAMES:
            problems.append(SpecError(f"{where}.hookName", f"{hook.hook_name!r} is not a hook "
                                      f"name (one of {', '.join(sorted(HOOK_NAMES))})"))
        if not hook.path:
            problems.append(SpecError(f"{where}.path", "is empty; a hook needs a path"))
        _env(problems, f"{where}.env", hook.env)
        _range(problems, f"{where}.timeout", hook.timeout, 0, UINT32_MAX, "a timeout")
    for i, mount in enumerate(edits.mounts):
        where = f"{path}.mounts[{i}]"
        if not mount.host_path:
            problems.append(SpecError(f"{where}.hostPath", "is empty; a mount needs a hostPath"))
        if not mount.container_path:
            problems.append(SpecError(f"{where}.containerPath",
                                      "is empty; a mount needs a containerPath"))
    rdt = edits.intel_rdt
    if rdt is not None and rdt.clos_id is not None:
        c = rdt.clos_id
        # A Linux file name, or "/" for the root class of service.
        if c != "/" and (len(c) >= _CLOS_ID_MAX or c in (".", "..") or "/" in c or "\n" in c):
            problems.append(SpecError(f"{path}.intelRdt.closID",
                                      f"{c!r} is not a valid class-of-service file name"))
    hosts: dict[str, int] = {}
    names: dict[str, int] = {}
    for i, net in enumerate(edits.net_devices):
        where = f"{path}.netDevices[{i}]"
        for attr, json_name, seen in (("host_interface_name", "hostInterfaceName", hosts),
                                      ("name", "name", names)):
            value = getattr(net, attr)
            if not value:
                problems.append(SpecError(f"{where}.{json_name}", "is empty"))
            elif value in seen:
                problems.append(SpecError(f"{where}.{json_name}", f"{value!r} is already used "
                                          f"by {path}.netDevices[{seen[value]}]"))
            else:
                seen[value] = i
    for i, gid in enumerate(edits.additional_gids):
        _range(problems, f"{path}.additionalGids[{i}]", gid, 0, UINT32_MAX, "a gid")
    return problems


def _version_problems(spec: Spec) -> list[SpecError]:
    declared = spec.cdi_version
    if not is_known_version(declared):
        try:
            older = version_key(declared) < version_key(EARLIEST_VERSION)
        except ValueError:
            older = False
        if older:
            return [SpecError("cdiVersion", f"{declared!r} is older than the earliest supported "
                                            f"version {EARLIEST_VERSION}")]
        return [SpecError("cdiVersion", f"{declared!r} is not a known CDI version "
                                        f"(known: {', '.join(KNOWN_VERSIONS)})")]
    problems = []
    have = version_key(declared)
    for req in requirements(spec):
        if version_key(req.version) > have:
            problems.append(SpecError(req.field, f"using {req.reason} needs cdiVersion "
                                                 f"{req.version} or later, but the spec declares "
                                                 f"{declared}"))
    if have >= version_key(INTEL_RDT_MONITORING_VERSION):
        edits = [("containerEdits", spec.container_edits)] + [
            (f"devices[{i}].containerEdits", d.container_edits) for i, d in enumerate(spec.devices)]
        for path, e in edits:
            for attr, json_name in (("enable_cmt", "enableCMT"), ("enable_mbm", "enableMBM")):
                if e.intel_rdt is not None and getattr(e.intel_rdt, attr) is not None:
                    problems.append(SpecError(
                        f"{path}.intelRdt.{json_name}",
                        f"was removed in cdiVersion {INTEL_RDT_MONITORING_VERSION} (the spec "
                        f"declares {normalize_version(declared)}); use enableMonitoring"))
    return problems


def spec_problems(spec: Spec) -> list[SpecError]:
    """Every CDI rule ``spec`` breaks, each naming its field; empty when valid."""
    problems = _version_problems(spec)
    try:
        parse_kind(spec.kind)
    except InvalidNameError as err:
        problems.append(SpecError("kind", str(err)))
    _annotations(problems, "annotations", spec.annotations)
    problems.extend(edits_problems(spec.container_edits, "containerEdits"))
    if not spec.devices:
        problems.append(SpecError("devices", "is empty; a spec needs at least one device"))
    seen: dict[str, int] = {}
    for i, device in enumerate(spec.devices):
        path = f"devices[{i}]"
        try:
            validate_device_name(device.name)
        except InvalidNameError as err:
            problems.append(SpecError(f"{path}.name", str(err)))
        if device.name in seen:
            problems.append(SpecError(f"{path}.name", f"duplicate device name {device.name!r} "
                                                      f"(also devices[{seen[device.name]}])"))
        else:
            seen[device.name] = i
        _annotations(problems, f"{path}.annotations", device.annotations)
        if device.container_edits.is_empty():
            problems.append(SpecError(f"{path}.containerEdits",
                                      "is empty; a device needs at least one edit"))
        problems.extend(edits_problems(device.container_edits, f"{path}.containerEdits"))
    return problems


def validate_spec(spec: Spec) -> None:
    """Raise InvalidSpecError (listing every problem, each naming its field) unless valid."""
    problems = spec_problems(spec)
    if problems:
        raise InvalidSpecError(problems)
