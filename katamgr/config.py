"""The kata manager's configuration: the GPU Operator's ``kataManager.config`` shape.

The file an operator writes (or the Helm chart renders into a ConfigMap) is
untrusted input, so every field is checked and *all* problems are reported in
one ``ConfigError``: fixing a config one error per run wastes a rollout each.
Unknown keys are errors too, since a typo like ``runtimeClases`` would
otherwise silently fall back to the defaults.

The config is a set of pydantic models (``extra="forbid"``, frozen, camelCase
aliases for the YAML keys, snake_case attributes for Python). Each field's own
check raises a ``ValueError`` whose text names the value and the fix; pydantic
collects them all, and ``_problems`` turns each error's location into our path
style (``runtimeClasses[0].nodeSelector["a"]``). A ``null`` stands for the
field's default (for ``runtimeClasses`` and ``containerd.podAnnotations``: none).
The same models give the JSON schema the Helm chart checks values against
(``katamgr.config_schema``).
"""

from __future__ import annotations

import json
import re
import typing
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from types import MappingProxyType, UnionType
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError, PydanticUseDefault

from katamgr import k8snames
from katamgr.artifacts.refs import ArtifactRef, LayoutRef, parse_ref
from katamgr.errors import ConfigError
from katamgr.host import selection as device_selection
from katamgr.host.workload import WORKLOAD_LABEL, Workload
from katamgr.runtime.settings import (
    CONFIGURABLE_VERSIONS,
    DEFAULT_CONFIG_PATH,
    DEFAULT_POD_ANNOTATIONS,
    DEFAULT_RESTART_MODE,
    DEFAULT_SOCKET,
    RestartMode,
)

DEFAULT_ARTIFACTS_DIR = "/opt/nvidia-gpu-operator/artifacts/runtimeclasses"
# A RuntimeClass with an empty nodeSelector in the config still must only
# schedule onto nodes prepared for passthrough, like the GPU Operator does.
DEFAULT_NODE_SELECTOR: Mapping[str, str] = MappingProxyType(
    {WORKLOAD_LABEL: Workload.VM_PASSTHROUGH.value}
)

DEFAULT_GPU_ARTIFACTS = "nvcr.io/nvidia/cloud-native/kata-gpu-artifacts:ubuntu22.04-535.54.03"
DEFAULT_SNP_ARTIFACTS = "nvcr.io/nvidia/cloud-native/kata-gpu-artifacts:ubuntu22.04-535.86.10-snp"

RESTART_MODES = tuple(mode.value for mode in RestartMode)
MAX_CONFIG_BYTES = 1 << 20

# A registry reachable over plain HTTP: host[:port].
_HOST_COMPONENT = r"([A-Za-z0-9]|[A-Za-z0-9][-A-Za-z0-9]*[A-Za-z0-9])"
REGISTRY_HOST_PATTERN = rf"^{_HOST_COMPONENT}(\.{_HOST_COMPONENT})*(:[0-9]{{1,5}})?$"
_REGISTRY_HOST = re.compile(REGISTRY_HOST_PATTERN)


# --- messages ---------------------------------------------------------------

_TYPE_NAMES = {
    bool: "a boolean",
    int: "a number",
    float: "a number",
    str: "a string",
    list: "a list",
    dict: "a mapping",
    type(None): "null",
}


def _q(value: Any) -> str:
    """A value as it appears in messages: strings double-quoted, like kubectl prints them."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return repr(value)


def _kind(value: Any) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


class _Says:
    """Field metadata for messages pydantic's own errors lack: what a missing field
    needs, and what a value of the wrong type must be ("it must be a list")."""

    def __init__(self, *, missing: str | None = None, expect: str | None = None):
        self.missing = missing
        self.expect = expect


# --- field checks -------------------------------------------------------------
# Each check returns why a string is not acceptable, or None.


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
            raise ValueError(f"is {_kind(value)}; it must be a string")
        if problem := check(value):
            raise ValueError(f"{_q(value)} {problem}")
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
        raise ValueError(f"key {_q(key)} is {_kind(key)}; label keys are strings")
    if problem := k8snames.label_key_problem(key):
        raise ValueError(f"key {_q(key)} is not a valid label key: {problem}")
    return key


def _label_value(value: Any) -> str:
    if isinstance(value, bool):
        raise ValueError(f"is a boolean; quote it (\"{str(value).lower()}\")")
    if not isinstance(value, str):
        raise ValueError(f"is {_kind(value)}; label values are strings (quote it)")
    if problem := k8snames.label_value_problem(value):
        raise ValueError(f"{_q(value)} is not a valid label value: {problem}")
    return value


def _resource_key(key: Any) -> str:
    if not isinstance(key, str) or k8snames.label_key_problem(key):
        raise ValueError(f"key {_q(key)} is not a resource name (e.g. cpu, memory)")
    return key


def _quantity(value: Any) -> str:
    """A quantity as the API takes it; YAML numbers (``cpu: 1``) become their text."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"is {_kind(value)}; it must be a quantity like 250m or 160Mi")
    text = str(value)
    if not k8snames.is_quantity(text):
        raise ValueError(f"{_q(text)} is not a Kubernetes quantity (e.g. 250m, 160Mi, 1)")
    return text


def _containerd_version(value: Any) -> Any:
    if value is None or (type(value) is int and value in CONFIGURABLE_VERSIONS):
        return value
    versions = ", ".join(str(v) for v in CONFIGURABLE_VERSIONS)
    raise ValueError(f"{_q(value)} is not a containerd config version; "
                     f"use {versions} or null (detect)")


def _restart_mode(value: Any) -> RestartMode:
    if not isinstance(value, str):
        raise ValueError(f"is {_kind(value)}; it must be a string")
    if value not in RESTART_MODES:
        raise ValueError(f"{_q(value)} is not a restart mode; use one of {', '.join(RESTART_MODES)}")
    return RestartMode(value)


def _annotation_glob(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{_q(value)} must be a non-empty string (an annotation glob)")
    return value


# --- field types: the check, and the JSON schema the chart gets for it --------------

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
    _Says(expect="it must be a mapping of label keys to values"),
]
PodFixed = Annotated[
    dict[Annotated[str, BeforeValidator(_resource_key)], Annotated[str, BeforeValidator(_quantity)]],
    WithJsonSchema(_keyed_by_label_keys({"anyOf": [
        {"type": "string", "pattern": k8snames.QUANTITY_PATTERN},
        {"type": "number", "minimum": 0},
    ]})),
    _Says(expect="it must map resource names to quantities"),
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
_NULL_IS_DEFAULT = BeforeValidator(_use_default_for_null)
_NULL_IS_EMPTY = BeforeValidator(_empty_for_null)


# --- the config model ------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        alias_generator=to_camel,  # pull_secret <-> pullSecret
        validate_by_name=True,  # Python callers use the attribute names
        validate_by_alias=True,
    )


class Artifacts(_Model):
    url: Annotated[
        ArtifactUrl, _Says(missing=f"give the artifacts image, e.g. {DEFAULT_GPU_ARTIFACTS}")
    ] = Field(description="The artifacts image (host/repo:tag or @sha256:...), or "
                          "oci-layout:///PATH[:TAG] for an OCI layout on the node.")
    # a kubernetes.io/dockerconfigjson Secret in the agent's namespace
    pull_secret: Annotated[SecretName, _NULL_IS_DEFAULT] = ""

    @property
    def source(self) -> ArtifactRef:
        """The parsed reference: a RegistryRef, or a LayoutRef for oci-layout://."""
        return parse_ref(self.url)


class RuntimeClassConfig(_Model):
    name: Annotated[RuntimeClassName, _Says(missing="every runtime class needs a name")]
    node_selector: Annotated[NodeSelector, _NULL_IS_DEFAULT] = Field(default_factory=dict)
    artifacts: Annotated[
        Artifacts, BeforeValidator(_missing_if_null),
        _Says(missing="every runtime class needs artifacts.url"),
    ]

    @property
    def handler(self) -> str:
        return self.name

    @property
    def scheduling_node_selector(self) -> dict[str, str]:
        """The RuntimeClass's scheduling.nodeSelector: the configured one or the default."""
        return dict(self.node_selector or DEFAULT_NODE_SELECTOR)


class ContainerdConfig(_Model):
    config_path: Annotated[AbsolutePath, _NULL_IS_DEFAULT] = DEFAULT_CONFIG_PATH
    socket: Annotated[AbsolutePath, _NULL_IS_DEFAULT] = DEFAULT_SOCKET
    version: ContainerdVersion = None  # None: detect from the existing config
    restart_mode: Annotated[RestartModeField, _NULL_IS_DEFAULT] = DEFAULT_RESTART_MODE
    pod_annotations: Annotated[tuple[AnnotationGlob, ...], _NULL_IS_EMPTY] = DEFAULT_POD_ANNOTATIONS


class RuntimeClassOverhead(_Model):
    # e.g. {"memory": "160Mi", "cpu": "250m"}; empty = none
    pod_fixed: Annotated[PodFixed, _NULL_IS_DEFAULT] = Field(default_factory=dict)


class IncludedDevice(_Model):
    ids: Annotated[PciIds, _Says(missing="give the PCI ids as vendor:device, e.g. 1234:11e8")] = Field(
        description="PCI vendor:device ids (4 hex digits each) of the devices to pass through.")
    resource: Annotated[ResourceName, _Says(missing="give the resource to advertise, e.g. example.com/edu")] = Field(
        description="The extended resource (domain/name) they are advertised as; also the CDI "
                    "kind of their spec.")


class DevicesConfig(_Model):
    """Which PCI devices are passthrough devices (``katamgr.host.selection``). By default
    NVIDIA GPUs and NVSwitches; the command line's --include-device and --exclude-device
    add to these lists."""

    include: Annotated[
        tuple[IncludedDevice, ...], _NULL_IS_EMPTY,
        _Says(expect="it must be a list of {ids, resource}"),
    ] = Field(default=(), description="Devices to pass through besides NVIDIA GPUs and NVSwitches.")
    exclude: Annotated[
        tuple[ExcludedDevice, ...], _NULL_IS_EMPTY,
        _Says(expect="it must be a list of PCI addresses (0000:01:00.0) or vendor:device ids"),
    ] = Field(default=(), description="Devices never to pass through, by full PCI address "
                                      "(0000:01:00.0) or vendor:device ids (10de:1eb8); they "
                                      "stay on their drivers. Wins over include.")

    @field_validator("include", mode="after")
    @classmethod
    def _one_resource_per_ids(cls, value: tuple[IncludedDevice, ...]) -> tuple[IncludedDevice, ...]:
        first: dict[str, IncludedDevice] = {}
        for entry in value:
            seen = first.setdefault(entry.ids, entry)
            if seen.resource != entry.resource:
                raise ValueError(f"includes {_q(entry.ids)} twice, as {_q(seen.resource)} and "
                                 f"{_q(entry.resource)}; a device is advertised under one resource")
        return value

    @property
    def selection(self) -> device_selection.Selection:
        return device_selection.Selection(
            tuple(device_selection.include_rule(e.ids, e.resource, device_selection.INCLUDE_CONFIG)
                  for e in self.include),
            tuple(device_selection.parse_exclude(e, device_selection.EXCLUDE_CONFIG) for e in self.exclude),
        )


def default_runtime_classes() -> tuple[RuntimeClassConfig, ...]:
    return (
        RuntimeClassConfig(
            name="kata-qemu-nvidia-gpu", artifacts=Artifacts(url=DEFAULT_GPU_ARTIFACTS)
        ),
        RuntimeClassConfig(
            name="kata-qemu-nvidia-gpu-snp",
            artifacts=Artifacts(url=DEFAULT_SNP_ARTIFACTS),
            node_selector={"nvidia.com/cc.capable": "true"},
        ),
    )


class KataManagerConfig(_Model):
    artifacts_dir: Annotated[AbsolutePath, _NULL_IS_DEFAULT] = DEFAULT_ARTIFACTS_DIR
    # Absent: the GPU Operator's two classes; null or []: none.
    runtime_classes: Annotated[tuple[RuntimeClassConfig, ...], _NULL_IS_EMPTY] = Field(
        default_factory=default_runtime_classes)
    containerd: Annotated[ContainerdConfig, _NULL_IS_DEFAULT] = Field(
        default_factory=ContainerdConfig)
    runtime_class_overhead: Annotated[RuntimeClassOverhead, _NULL_IS_DEFAULT] = Field(
        default_factory=RuntimeClassOverhead,
        description="Added to every RuntimeClass as overhead (what each Kata VM costs "
                    "beyond its containers).")
    insecure_registries: Annotated[
        tuple[RegistryHost, ...], _NULL_IS_DEFAULT,
        _Says(expect="it must be a list of host[:port]"),
    ] = Field(default=(), description="Registries (host[:port]) that may be reached over "
                                      "plain HTTP.")
    devices: Annotated[DevicesConfig, _NULL_IS_DEFAULT] = Field(
        default_factory=DevicesConfig,
        description="Which PCI devices are passed through (default: NVIDIA GPUs and NVSwitches).")

    @field_validator("runtime_classes", mode="wrap")
    @classmethod
    def _names_are_unique(cls, value: Any, handler: Callable[[Any], Any]) -> Any:
        """A repeated name is reported next to the entries' own problems."""
        failure: ValidationError | None = None
        try:
            result = handler(value)
        except ValidationError as e:
            failure, result = e, None
        duplicates = []
        first: dict[str, int] = {}
        for i, entry in enumerate(value if isinstance(value, list | tuple) else ()):
            name = entry.name if isinstance(entry, RuntimeClassConfig) else (
                entry.get("name") if isinstance(entry, dict) else None)
            if not isinstance(name, str) or not k8snames.is_dns1123_label(name):
                continue  # no name, or a bad one: reported as such
            if name not in first:
                first[name] = i
                continue
            message = (f"{_q(name)} duplicates runtimeClasses[{first[name]}].name; "
                       "runtime class names must be unique")
            duplicates.append({"type": PydanticCustomError("duplicate", "{message}",
                                                           {"message": message}),
                               "loc": (i, "name"), "input": name})
        if not duplicates:
            if failure is not None:
                raise failure
            return result
        errors = [*(failure.errors(include_url=False) if failure else ()), *duplicates]
        raise ValidationError.from_exception_data(cls.__name__, errors)

    @property
    def overhead_pod_fixed(self) -> Mapping[str, str]:
        """RuntimeClass overhead.podFixed, e.g. {"memory": "160Mi", "cpu": "250m"}; empty = none."""
        return self.runtime_class_overhead.pod_fixed

    def runtime_class(self, name: str) -> RuntimeClassConfig | None:
        return next((rc for rc in self.runtime_classes if rc.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        """The YAML shape (camelCase keys) this config was loaded from."""
        return self.model_dump(mode="json", by_alias=True)


def default_config() -> KataManagerConfig:
    return KataManagerConfig()


# --- loading ---------------------------------------------------------------


class InvalidConfig(ConfigError):
    """A config with one or more problems; ``problems`` lists each one."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = list(problems)
        count = f"{len(problems)} problem" + ("s" if len(problems) != 1 else "")
        listing = "".join(f"\n  - {p}" for p in problems)
        super().__init__(f"invalid kata manager config {source} ({count}; fix each):{listing}")


def load_config(path: str | Path | None) -> KataManagerConfig:
    """Load the config file at ``path``; None means the built-in default."""
    if path is None:
        return default_config()
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(
            f"cannot read kata manager config {path}: {e.strerror}; check the path"
        ) from e
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"kata manager config {path} is larger than {MAX_CONFIG_BYTES} bytes; "
            "is it the right file?"
        )
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        raise ConfigError(f"kata manager config {path} is not UTF-8 text") from e
    return parse_config(text, source=str(path))


def parse_config(text: str, source: str = "<string>") -> KataManagerConfig:
    """Parse and validate a config given as YAML text."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"kata manager config {source} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(f"kata manager config {source} is not valid YAML: {e}") from e
    return config_from_dict(data, source=source)


def config_from_dict(data: Any, source: str = "<dict>") -> KataManagerConfig:
    """Validate already-parsed data; raise InvalidConfig listing every problem."""
    if data is None:
        data = {}  # an empty file: every default
    try:
        return KataManagerConfig.model_validate(data)
    except ValidationError as e:
        raise InvalidConfig(source, _problems(e)) from None


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML keeps the last one silently)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict:
    loader.flatten_mapping(node)
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:
            continue  # unhashable key: construct_mapping reports it
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {_q(key)}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


# --- pydantic's errors in our words --------------------------------------------------

_CONTAINER_TYPES = {
    "model_type": "it must be a mapping",
    "model_attributes_type": "it must be a mapping",
    "dict_type": "it must be a mapping",
    "list_type": "it must be a list",
    "tuple_type": "it must be a list",
}


def _problems(error: ValidationError) -> list[str]:
    """One line per problem: the path in our style, then what is wrong and the fix."""
    return [_problem(e) for e in error.errors(include_url=False)]


def _problem(error: Mapping[str, Any]) -> str:
    loc = tuple(error["loc"])
    kind = error["type"]
    if loc and loc[-1] == "[key]":
        # A bad mapping key: reported at the mapping ("nodeSelector key "x" is ...").
        where, _, _ = _locate(loc[:-2])
    else:
        where, says, _ = _locate(loc)
    value = error.get("input")
    if kind == "value_error":
        message = str(error["ctx"]["error"])
    elif kind == "missing":
        message = "is missing" + (f"; {says.missing}" if says and says.missing else "")
    elif kind in ("extra_forbidden", "invalid_key"):  # invalid_key: not even a string
        _, _, parent = _locate(loc[:-1])
        known = ", ".join(_aliases(parent)) if parent else ""
        message = f"is not a known key (known: {known})"
    elif kind in _CONTAINER_TYPES:
        if not loc:
            return f"the config is {_kind(value)}; {_CONTAINER_TYPES[kind]}"
        expect = says.expect if says and says.expect else _CONTAINER_TYPES[kind]
        message = f"is {_kind(value)}; {expect}"
    else:
        message = error["msg"]
    return f"{where} {message}" if where else message


def _aliases(model: type[BaseModel]) -> list[str]:
    return [f.alias or name for name, f in model.model_fields.items()]


def _locate(loc: tuple[Any, ...]) -> tuple[str, _Says | None, type[BaseModel] | None]:
    """Walk the models along ``loc``: our path for it, the message metadata of the field
    it ends at, and the model there (None where it is not a model)."""
    tp: Any = KataManagerConfig
    path = ""
    says: _Says | None = None
    for part in loc:
        tp, says = _unwrap(tp), None
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            field = next((f for n, f in tp.model_fields.items() if (f.alias or n) == part), None)
            path = f"{path}.{part}" if path else str(part)
            tp = field.annotation if field else None
            says = next((m for m in field.metadata if isinstance(m, _Says)), None) if field else None
        elif typing.get_origin(tp) in (tuple, list) and isinstance(part, int):
            tp = typing.get_args(tp)[0]
            path += f"[{part}]"
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
            path += f"[{_q(part)}]"
        else:
            tp = None
            path += f"[{part}]" if isinstance(part, int) else f".{part}"
    tp = _unwrap(tp)
    return path, says, tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _unwrap(tp: Any) -> Any:
    """The type inside ``Annotated[...]`` and ``X | None``."""
    while True:
        args = typing.get_args(tp)
        if typing.get_origin(tp) is Annotated:
            tp = args[0]
        elif (typing.get_origin(tp) in (typing.Union, UnionType)
              and len(args) == 2 and type(None) in args):
            tp = next(a for a in args if a is not type(None))
        else:
            return tp
