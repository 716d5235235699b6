"""The config's field types: each one's check, and the JSON schema the chart gets for it.

A check returns why a string is not acceptable (or None); ``_text`` wraps one into a
pydantic validator whose error names the value. Each type below pairs that validator with
the schema ``katamgr.config_schema`` writes into the chart's ``values.schema.json``, so that
Helm refuses at install what the agent would refuse on the node.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, WithJsonSchema
from pydantic_core import PydanticCustomError, PydanticUseDefault

from gpunode import k8snames
from gpunode.errors import ConfigError
from gpunode.policy import health, katarelease, split
from gpunode.policy import selection as device_selection
from gpunode.services import nvlinkfabric
from katamgr.artifacts.refs import LayoutRef, parse_ref
from katamgr.config.messages import Says, kind_of, quote
from katamgr.runtime.kata_config import POD_RESOURCE_SOURCES
from katamgr.runtime.settings import CONFIGURABLE_VERSIONS, RestartMode

RESTART_MODES = tuple(mode.value for mode in RestartMode)

# A registry reachable over plain HTTP: host[:port].
_HOST_COMPONENT = r"([A-Za-z0-9]|[A-Za-z0-9][-A-Za-z0-9]*[A-Za-z0-9])"
REGISTRY_HOST_PATTERN = rf"^{_HOST_COMPONENT}(\.{_HOST_COMPONENT})*(:[0-9]{{1,5}})?$"
_REGISTRY_HOST = re.compile(REGISTRY_HOST_PATTERN)


def _path_problem(value: str) -> str | None:
    problem = _absolute_problem(value, "it")
    return f"is not a usable path: {problem}" if problem else None


def _absolute_problem(path: str, what: str) -> str | None:
    if not path.startswith("/"):
        return f"{what} must be absolute"
    if PurePosixPath(path) == PurePosixPath("/"):
        return f"{what} must not be the root directory"
    if ".." in PurePosixPath(path).parts:
        return f"{what} must not contain '..'"
    if "\0" in path:
        return f"{what} must not contain NUL"
    return None


def _url_problem(value: str) -> str | None:
    try:
        ref = parse_ref(value)
    except ConfigError as e:
        return f"is not an artifact reference: {e}"
    if isinstance(ref, LayoutRef):
        # The layout is read on the node: a relative or '..' path would depend on
        # the agent's working dir or escape the dir the operator meant.
        if problem := _absolute_problem(str(ref.path), "the layout path"):
            return f"is not an artifact reference: {problem}"
    return None


def _runtime_class_name_problem(value: str) -> str | None:
    if k8snames.is_dns1123_label(value):
        return None
    return (f"is not a DNS-1123 label (lowercase letters, digits, '-', "
            f"at most {k8snames.DNS1123_LABEL_MAX})")


def _secret_name_problem(value: str) -> str | None:
    if value == "" or k8snames.is_dns1123_subdomain(value):
        return None
    return "is not a valid Secret name (DNS-1123 subdomain)"


def _registry_problem(value: str) -> str | None:
    return None if _REGISTRY_HOST.fullmatch(value) else "is not a host or host:port"


def _text(check: Callable[[str], str | None], *, required: bool = False,
          normalize: Callable[[str], str] | None = None) -> BeforeValidator:
    """A string field: the type, then ``check``; with ``required``, null and "" are missing."""

    def validate(value: Any) -> Any:
        if required and (value is None or value == ""):
            raise PydanticCustomError("missing", "Field required")
        if not isinstance(value, str):
            raise ValueError(f"is {kind_of(value)}; it must be a string")
        if problem := check(value):
            raise ValueError(f"{quote(value)} {problem}")
        return normalize(value) if normalize else value

    return BeforeValidator(validate)


def _missing_if_null(value: Any) -> Any:
    if value is None:
        raise PydanticCustomError("missing", "Field required")
    return value


def _use_default_for_null(value: Any) -> Any:
    if value is None:
        raise PydanticUseDefault()
    return value


def _empty_for_null(value: Any) -> Any:
    return () if value is None else value


def _label_key(key: Any) -> str:
    if not isinstance(key, str):
        raise ValueError(f"key {quote(key)} is {kind_of(key)}; label keys are strings")
    if problem := k8snames.label_key_problem(key):
        raise ValueError(f"key {quote(key)} is not a valid label key: {problem}")
    return key


def _label_value(value: Any) -> str:
    if isinstance(value, bool):
        raise ValueError(f"is a boolean; quote it (\"{str(value).lower()}\")")
    if not isinstance(value, str):
        raise ValueError(f"is {kind_of(value)}; label values are strings (quote it)")
    if problem := k8snames.label_value_problem(value):
        raise ValueError(f"{quote(value)} is not a valid label value: {problem}")
    return value


def _resource_key(key: Any) -> str:
    if not isinstance(key, str) or k8snames.label_key_problem(key):
        raise ValueError(f"key {quote(key)} is not a resource name (e.g. cpu, memory)")
    return key


def _quantity(value: Any) -> str:
    """A quantity as the API takes it; YAML numbers (``cpu: 1``) become their text."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"is {kind_of(value)}; it must be a quantity like 250m or 160Mi")
    text = str(value)
    if not k8snames.is_quantity(text):
        raise ValueError(f"{quote(text)} is not a Kubernetes quantity (e.g. 250m, 160Mi, 1)")
    return text


def _containerd_version(value: Any) -> Any:
    if value is None or (type(value) is int and value in CONFIGURABLE_VERSIONS):
        return value
    versions = ", ".join(str(v) for v in CONFIGURABLE_VERSIONS)
    raise ValueError(f"{quote(value)} is not a containerd config version; "
                     f"use {versions} or null (detect)")


def _restart_mode(value: Any) -> RestartMode:
    if not isinstance(value, str):
        raise ValueError(f"is {kind_of(value)}; it must be a string")
    if value not in RESTART_MODES:
        raise ValueError(f"{quote(value)} is not a restart mode; use one of {', '.join(RESTART_MODES)}")
    return RestartMode(value)


def _nvswitches(value: Any) -> bool | str:
    """``auto``, or a YAML boolean (``true``: pass them through, ``false``: never)."""
    if value is True or value is False or value == "auto":
        return value
    raise ValueError(f"{quote(value)} is not auto, true or false")


def _nvlink_fabric(value: Any) -> str:
    if value not in nvlinkfabric.MODELS:
        raise ValueError(f"{quote(value)} is not an NVLink fabric model; use one of {', '.join(nvlinkfabric.MODELS)}")
    return value


def _link_policy(value: Any) -> str:
    if value not in health.LINK_POLICIES:
        raise ValueError(f"{quote(value)} is not a link policy; use one of {', '.join(health.LINK_POLICIES)}")
    return value


def _module_ids_problem(value: str) -> str | None:
    try:
        nvlinkfabric.parse_module_ids(value)
    except ValueError as e:
        return f"has a bad entry: {e}"
    return None


def _kata_release_problem(value: str) -> str | None:
    try:
        katarelease.parse_release(value)
    except ValueError:
        return "is not a Kata Containers release such as 3.25.0"
    return None


def _device_source(value: Any) -> str:
    if value not in POD_RESOURCE_SOURCES:
        raise ValueError(f"{quote(value)} is not a PodResources device source; use "
                         f"{' or '.join(POD_RESOURCE_SOURCES)}")
    return value


def _annotation_glob(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{quote(value)} must be a non-empty string (an annotation glob)")
    return value


_ABSOLUTE_PATH_SCHEMA = {
    "type": "string",
    "pattern": "^/",
    "not": {"anyOf": [{"pattern": r"(^|/)\.\.(/|$)"}, {"pattern": "^/+$"}]},
}
AbsolutePath = Annotated[
    str,
    _text(_path_problem, normalize=lambda s: str(PurePosixPath(s))),
    WithJsonSchema(_ABSOLUTE_PATH_SCHEMA),
]
RuntimeClassName = Annotated[
    str,
    _text(_runtime_class_name_problem, required=True),
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": k8snames.DNS1123_LABEL_MAX,
                    "pattern": k8snames.DNS1123_LABEL_PATTERN}),
]
ArtifactUrl = Annotated[
    str, _text(_url_problem, required=True), WithJsonSchema({"type": "string", "minLength": 1})
]
SecretName = Annotated[
    str,
    _text(_secret_name_problem),
    WithJsonSchema({"anyOf": [
        {"type": "string", "maxLength": 0},
        {"type": "string", "minLength": 1, "maxLength": k8snames.DNS1123_SUBDOMAIN_MAX,
         "pattern": k8snames.DNS1123_SUBDOMAIN_PATTERN},
    ]}),
]


def _keyed_by_label_keys(values: dict[str, Any]) -> dict[str, Any]:
    """A mapping's schema: label keys (a bad key is an "additional property", which Helm
    reports at the mapping's path) to ``values``."""
    return {
        "type": "object",
        "patternProperties": {k8snames.LABEL_KEY_PATTERN: values},
        "additionalProperties": False,
        "propertyNames": {"maxLength": k8snames.LABEL_KEY_MAX},
    }


NodeSelector = Annotated[
    dict[Annotated[str, BeforeValidator(_label_key)], Annotated[str, BeforeValidator(_label_value)]],
    WithJsonSchema(_keyed_by_label_keys({"type": "string", "pattern": k8snames.LABEL_VALUE_PATTERN})),
    Says(expect="it must be a mapping of label keys to values"),
]
PodFixed = Annotated[
    dict[Annotated[str, BeforeValidator(_resource_key)], Annotated[str, BeforeValidator(_quantity)]],
    WithJsonSchema(_keyed_by_label_keys({"anyOf": [
        {"type": "string", "pattern": k8snames.QUANTITY_PATTERN},
        {"type": "number", "minimum": 0},
    ]})),
    Says(expect="it must map resource names to quantities"),
]
PciIds = Annotated[
    str,
    _text(device_selection.ids_problem, required=True, normalize=str.lower),
    WithJsonSchema({"type": "string", "pattern": device_selection.IDS_PATTERN}),
]
ResourceName = Annotated[
    str,
    _text(device_selection.resource_problem, required=True),
    WithJsonSchema({"type": "string", "pattern": device_selection.RESOURCE_PATTERN,
                    "not": {"pattern": "kubernetes\\.io/"}}),
]
ExcludedDevice = Annotated[
    str,
    _text(device_selection.exclude_problem, required=True, normalize=str.lower),
    WithJsonSchema({"type": "string", "pattern": device_selection.EXCLUDE_PATTERN}),
]
RegistryHost = Annotated[
    str, _text(_registry_problem), WithJsonSchema({"type": "string", "pattern": REGISTRY_HOST_PATTERN})
]
AnnotationGlob = Annotated[
    str, BeforeValidator(_annotation_glob), WithJsonSchema({"type": "string", "minLength": 1})
]
ContainerdVersion = Annotated[
    Literal[CONFIGURABLE_VERSIONS] | None, BeforeValidator(_containerd_version)
]
RestartModeField = Annotated[RestartMode, BeforeValidator(_restart_mode)]
NvswitchMode = Annotated[
    bool | Literal["auto"], BeforeValidator(_nvswitches),
    WithJsonSchema({"anyOf": [{"type": "boolean"}, {"type": "string", "enum": ["auto"]}]}),
]
# The same three values for "use the runtimes kata-deploy installed on a node" (kataDeploy).
KataDeployMode = NvswitchMode
KataRelease = Annotated[
    str, _text(_kata_release_problem),
    WithJsonSchema({"anyOf": [{"type": "string", "maxLength": 0},
                              {"type": "string", "pattern": r"^v?[0-9]+\.[0-9]+(\.[0-9]+)?$"}]}),
]
NvlinkFabricModel = Annotated[
    str, BeforeValidator(_nvlink_fabric), WithJsonSchema({"type": "string", "enum": list(nvlinkfabric.MODELS)}),
]
LinkPolicy = Annotated[
    str, BeforeValidator(_link_policy), WithJsonSchema({"type": "string", "enum": list(health.LINK_POLICIES)}),
]
GpuModuleIds = Annotated[str, _text(_module_ids_problem), WithJsonSchema({"type": "string"})]


def _split_value_problem(value: str) -> str | None:
    try:
        split.check_value(value)
    except ValueError as exc:
        return str(exc).removeprefix(f"{value!r} ")
    return None


# A node pool's split, the syntax of the label nvidia.com/gpu.workload.vm-passthrough.gpus.
SplitValue = Annotated[str, _text(_split_value_problem, required=True),
                       WithJsonSchema({"type": "string", "minLength": 1, "maxLength": 63,
                                       "pattern": k8snames.LABEL_VALUE_PATTERN})]
DeviceSource = Annotated[
    str, BeforeValidator(_device_source), WithJsonSchema({"type": "string", "enum": list(POD_RESOURCE_SOURCES)}),
]
NULL_IS_DEFAULT = BeforeValidator(_use_default_for_null)
NULL_IS_EMPTY = BeforeValidator(_empty_for_null)
NULL_IS_MISSING = BeforeValidator(_missing_if_null)
