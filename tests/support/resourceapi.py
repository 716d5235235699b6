"""resource.k8s.io/v1 for the in-process API server stand-in (``support.apiserver``):
ResourceSlices, ResourceClaims and DeviceClasses, with the rules of
k8s.io/kubernetes v1.35.4 our DRA driver could run into.

ResourceSlice (pkg/apis/resource/validation/validation.go ``validateResourceSliceSpec``,
``validateDevice``, ``validateDeviceAttribute``, ``validateQualifiedName``; limits from
pkg/apis/resource/types.go):

- ``spec.driver``: required, at most 63 characters, a DNS subdomain once lower-cased
  (``ValidateCSIDriverName``); ``spec.pool.name`` required, each ``/``-part a DNS
  subdomain; ``pool.resourceSliceCount`` > 0, ``pool.generation`` >= 0;
- exactly one of ``nodeName``, ``nodeSelector``, ``allNodes``,
  ``perDeviceNodeSelection``;
- at most 128 devices, names DNS labels and unique; per device at most 32
  attributes and capacities; an attribute has exactly one of int, bool, string,
  version, a string at most 64 characters; an attribute name is a C identifier of at
  most 32 characters, optionally after a driver-name-like domain and ``/``;
- on update ``spec.driver``, ``spec.pool.name`` and ``spec.nodeName`` are immutable.

Selectable fields of a ResourceSlice besides ``metadata.name``: ``spec.nodeName``
and ``spec.driver`` (pkg/registry/resource/resourceslice/strategy.go
``toSelectableFields``); any other field label is refused with 400, as the real
server does.
"""

from __future__ import annotations

import re

_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_DEVICES = 128
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_VALUE = 64
MAX_ID = 32


def _driver_problems(name: str | None, path: str) -> list[str]:
    if not name:
        return [f"{path}: Required value"]
    out = []
    if len(name) > 63:
        out.append(f"{path}: Too long: may not be more than 63 bytes")
    if not (len(name) <= 253 and _SUBDOMAIN.fullmatch(name.lower())):
        out.append(f'{path}: Invalid value: "{name}": a lowercase RFC 1123 subdomain must consist '
                   "of lower case alphanumeric characters, '-' or '.'")
    return out


def _qualified_name_problems(name: str, path: str) -> list[str]:
    parts = name.split("/")
    out = []
    if len(parts) == 2:
        out += (_driver_problems(parts[0], path) if parts[0]
                else [f'{path}: Invalid value: "": the domain must not be empty'])
        ident = parts[1]
    else:
        ident = parts[0]
    if len(ident) > MAX_ID:
        out.append(f"{path}: Too long: may not be more than {MAX_ID} bytes")
    if not _C_IDENTIFIER.fullmatch(ident):
        out.append(f'{path}: Invalid value: "{ident}": a valid C identifier must start with '
                   "alphabetic character or '_', followed by a string of alphanumeric "
                   "characters or '_'")
    return out


def slice_problems(obj: dict, old: dict | None) -> list[str]:
    spec = obj.get("spec") or {}
    problems = _driver_problems(spec.get("driver"), "spec.driver")
    pool = spec.get("pool") or {}
    if not pool.get("name"):
        problems.append("spec.pool.name: Required value")
    elif not all(_SUBDOMAIN.fullmatch(p) for p in pool["name"].split("/")):
        problems.append(f'spec.pool.name: Invalid value: "{pool["name"]}": a lowercase RFC 1123 subdomain')
    if int(pool.get("resourceSliceCount") or 0) <= 0:
        problems.append(f"spec.pool.resourceSliceCount: Invalid value: {pool.get('resourceSliceCount', 0)}: "
                        "must be greater than zero")
    if int(pool.get("generation") or 0) < 0:
        problems.append(f"spec.pool.generation: Invalid value: {pool.get('generation')}: must be "
                        "greater than or equal to zero")
    chosen = [f for f in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection") if spec.get(f)]
    if len(chosen) != 1:
        problems.append("spec: exactly one of `nodeName`, `nodeSelector`, `allNodes`, "
                        "`perDeviceNodeSelection` is required")
    devices = spec.get("devices") or []
    if len(devices) > MAX_DEVICES:
        problems.append(f"spec.devices: Too many: {len(devices)}: must have at most {MAX_DEVICES} items")
    seen: set[str] = set()
    for i, device in enumerate(devices):
        path = f"spec.devices[{i}]"
        name = device.get("name") or ""
        if not (len(name) <= 63 and _LABEL.fullmatch(name)):
            problems.append(f'{path}.name: Invalid value: "{name}": a lowercase RFC 1123 label')
        if name in seen:
            problems.append(f'{path}.name: Duplicate value: "{name}"')
        seen.add(name)
        attributes = device.get("attributes") or {}
        if len(attributes) + len(device.get("capacity") or {}) > MAX_ATTRIBUTES_AND_CAPACITIES:
            problems.append(f"{path}: the total number of attributes and capacities must not exceed "
                            f"{MAX_ATTRIBUTES_AND_CAPACITIES}")
        for key, value in attributes.items():
            at = f"{path}.attributes[{key}]"
            problems += _qualified_name_problems(key, at)
            set_values = [k for k in ("int", "bool", "string", "version") if (value or {}).get(k) is not None]
            if len(set_values) != 1:
                problems.append(f"{at}: Invalid value: exactly one value must be specified")
            for kind in ("string", "version"):
                text = (value or {}).get(kind)
                if isinstance(text, str) and len(text) > MAX_VALUE:
                    problems.append(f"{at}.{kind}: Too long: may not be more than {MAX_VALUE} bytes")
    if old is not None:
        old_spec = old.get("spec") or {}
        for field, new, was in (("driver", spec.get("driver"), old_spec.get("driver")),
                                ("pool.name", pool.get("name"), (old_spec.get("pool") or {}).get("name")),
                                ("nodeName", spec.get("nodeName"), old_spec.get("nodeName"))):
            if new != was:
                problems.append(f'spec.{field}: Invalid value: "{new}": field is immutable')
    return problems


def slice_fields(obj: dict) -> dict[str, str]:
    spec = obj.get("spec") or {}
    return {"spec.nodeName": spec.get("nodeName") or "", "spec.driver": spec.get("driver") or ""}
