"""Container Device Interface: spec model, validation and spec files.

A small, vendor-neutral library: ``Spec`` and friends model a CDI spec document,
``validate_spec``/``minimum_version`` apply the CDI rules, ``write_spec``/``read_spec``/
``remove_spec`` handle spec files, and ``load_specs`` resolves qualified device names
across spec directories. It depends on PyYAML only.

The names below load their module on first use (PEP 562), so a program that
only checks a CDI name does not pay for the spec model or PyYAML: the device
plugin's start-up, which the kubelet waits on, is one such program.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_MODULES: dict[str, tuple[str, ...]] = {
    "cdi.cache": (
        "DEFAULT_SPEC_DIRS", "DYNAMIC_SPEC_DIR", "LoadedSpec", "ResolvedDevice",
        "STATIC_SPEC_DIR", "SpecRegistry", "UnresolvedDeviceError", "load_specs",
    ),
    "cdi.errors": (
        "CDIError", "InvalidNameError", "InvalidSpecError", "SpecError", "SpecFileError",
    ),
    "cdi.files": (
        "FORMATS", "dump_spec", "parse_spec", "read_spec", "remove_spec", "spec_file_name",
        "write_spec",
    ),
    "cdi.model": (
        "ContainerEdits", "Device", "DeviceNode", "Hook", "IntelRdt", "Mount", "NetDevice",
        "Spec",
    ),
    "cdi.names": (
        "ANNOTATION_PREFIX", "annotation_key", "annotation_value", "is_qualified_name",
        "parse_annotations", "parse_kind", "parse_qualified_name", "qualified_name",
        "validate_class", "validate_device_name", "validate_vendor",
    ),
    "cdi.validate": (
        "HOOK_NAMES", "spec_problems", "validate_spec",
    ),
    "cdi.version": (
        "EARLIEST_VERSION", "KNOWN_VERSIONS", "LATEST_VERSION", "Requirement",
        "minimum_version", "requirements",
    ),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}

if TYPE_CHECKING:
    from cdi.cache import (
        DEFAULT_SPEC_DIRS,
        DYNAMIC_SPEC_DIR,
        STATIC_SPEC_DIR,
        LoadedSpec,
        ResolvedDevice,
        SpecRegistry,
        UnresolvedDeviceError,
        load_specs,
    )
    from cdi.errors import (
        CDIError,
        InvalidNameError,
        InvalidSpecError,
        SpecError,
        SpecFileError,
    )
    from cdi.files import (
        FORMATS,
        dump_spec,
        parse_spec,
        read_spec,
        remove_spec,
        spec_file_name,
        write_spec,
    )
    from cdi.model import (
        ContainerEdits,
        Device,
        DeviceNode,
        Hook,
        IntelRdt,
        Mount,
        NetDevice,
        Spec,
    )
    from cdi.names import (
        ANNOTATION_PREFIX,
        annotation_key,
        annotation_value,
        is_qualified_name,
        parse_annotations,
        parse_kind,
        parse_qualified_name,
        qualified_name,
        validate_class,
        validate_device_name,
        validate_vendor,
    )
    from cdi.validate import HOOK_NAMES, spec_problems, validate_spec
    from cdi.version import (
        EARLIEST_VERSION,
        KNOWN_VERSIONS,
        LATEST_VERSION,
        Requirement,
        minimum_version,
        requirements,
    )


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'cdi' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # found once; later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "ANNOTATION_PREFIX",
    "DEFAULT_SPEC_DIRS",
    "DYNAMIC_SPEC_DIR",
    "EARLIEST_VERSION",
    "FORMATS",
    "HOOK_NAMES",
    "KNOWN_VERSIONS",
    "LATEST_VERSION",
    "STATIC_SPEC_DIR",
    "CDIError",
    "ContainerEdits",
    "Device",
    "DeviceNode",
    "Hook",
    "IntelRdt",
    "InvalidNameError",
    "InvalidSpecError",
    "LoadedSpec",
    "Mount",
    "NetDevice",
    "Requirement",
    "ResolvedDevice",
    "Spec",
    "SpecError",
    "SpecFileError",
    "SpecRegistry",
    "UnresolvedDeviceError",
    "annotation_key",
    "annotation_value",
    "dump_spec",
    "is_qualified_name",
    "load_specs",
    "minimum_version",
    "parse_annotations",
    "parse_kind",
    "parse_qualified_name",
    "parse_spec",
    "qualified_name",
    "read_spec",
    "remove_spec",
    "requirements",
    "spec_file_name",
    "spec_problems",
    "validate_class",
    "validate_device_name",
    "validate_spec",
    "validate_vendor",
    "write_spec",
]
