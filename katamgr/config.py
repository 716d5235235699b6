"""The kata manager's configuration: the GPU Operator's ``kataManager.config`` shape.

The file an operator writes (or the Helm chart renders into a ConfigMap) is
untrusted input, so every field is checked and *all* problems are reported in
one ``ConfigError``: fixing a config one error per run wastes a rollout each.
Unknown keys are errors too, since a typo like ``runtimeClases`` would
otherwise silently fall back to the defaults.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any

import yaml
from kubernetes.utils.quantity import parse_quantity

from katamgr.artifacts.refs import ArtifactRef, LayoutRef, parse_ref
from katamgr.errors import ConfigError

DEFAULT_ARTIFACTS_DIR = "/opt/nvidia-gpu-operator/artifacts/runtimeclasses"
WORKLOAD_CONFIG_LABEL = "nvidia.com/gpu.workload.config"
# A RuntimeClass with an empty nodeSelector in the config still must only
# schedule onto nodes prepared for passthrough, like the GPU Operator does.
DEFAULT_NODE_SELECTOR: Mapping[str, str] = MappingProxyType(
    {WORKLOAD_CONFIG_LABEL: "vm-passthrough"}
)

DEFAULT_GPU_ARTIFACTS = "nvcr.io/nvidia/cloud-native/kata-gpu-artifacts:ubuntu22.04-535.54.03"
DEFAULT_SNP_ARTIFACTS = "nvcr.io/nvidia/cloud-native/kata-gpu-artifacts:ubuntu22.04-535.86.10-snp"

RESTART_MODES = ("signal", "systemd", "none")
CONTAINERD_VERSIONS = (2, 3)
MAX_CONFIG_BYTES = 1 << 20

# --- Kubernetes and OCI name grammars -------------------------------------

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
# Non-negative only: an overhead below zero makes no sense.
_QUANTITY = re.compile(
    r"\+?(\d+(\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][-+]?\d+)?"
)
_HOST_COMPONENT = r"([A-Za-z0-9]|[A-Za-z0-9][-A-Za-z0-9]*[A-Za-z0-9])"
_HOST = re.compile(rf"{_HOST_COMPONENT}(\.{_HOST_COMPONENT})*(:[0-9]{{1,5}})?")


def is_dns1123_label(value: str) -> bool:
    return len(value) <= 63 and _DNS_LABEL.fullmatch(value) is not None


def is_dns1123_subdomain(value: str) -> bool:
    return len(value) <= 253 and _DNS_SUBDOMAIN.fullmatch(value) is not None


def label_key_problem(key: str) -> str | None:
    """Why ``key`` is not a valid Kubernetes label key, or None."""
    prefix, slash, name = key.rpartition("/")
    if slash and not is_dns1123_subdomain(prefix):
        return f"its prefix {_q(prefix)} is not a DNS-1123 subdomain"
    if not name or len(name) > 63 or _LABEL_NAME.fullmatch(name) is None:
        return (
            "its name part must be 1-63 characters of letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit"
        )
    return None


def label_value_problem(value: str) -> str | None:
    """Why ``value`` is not a valid Kubernetes label value, or None."""
    if value == "":
        return None
    if len(value) > 63 or _LABEL_NAME.fullmatch(value) is None:
        return (
            "a label value must be at most 63 characters of letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit"
        )
    return None


def is_quantity(value: str) -> bool:
    return _QUANTITY.fullmatch(value) is not None


def quantity_value(value: str) -> Decimal:
    """The number a Kubernetes quantity stands for ("250m" -> 0.25)."""
    return parse_quantity(value)


# --- host paths ------------------------------------------------------------


def _check_absolute(path: str, what: str) -> None:
    if not path.startswith("/"):
        raise ValueError(f"{what} must be absolute")
    if PurePosixPath(path) == PurePosixPath("/"):
        raise ValueError(f"{what} must not be the root directory")
    if ".." in PurePosixPath(path).parts:
        raise ValueError(f"{what} must not contain '..'")
    if "\0" in path:
        raise ValueError(f"{what} must not contain NUL")


# --- the config model ------------------------------------------------------


@dataclass(frozen=True)
class Artifacts:
    url: str
    pull_secret: str = ""  # a kubernetes.io/dockerconfigjson Secret in the agent's namespace

    @property
    def source(self) -> ArtifactRef:
        """The parsed reference: a RegistryRef, or a LayoutRef for oci-layout://."""
        return parse_ref(self.url)


@dataclass(frozen=True)
class RuntimeClassConfig:
    name: str
    artifacts: Artifacts
    node_selector: Mapping[str, str] = field(default_factory=dict)  # as configured

    @property
    def handler(self) -> str:
        return self.name

    @property
    def scheduling_node_selector(self) -> dict[str, str]:
        """The RuntimeClass's scheduling.nodeSelector: the configured one or the default."""
        return dict(self.node_selector or DEFAULT_NODE_SELECTOR)


@dataclass(frozen=True)
class ContainerdConfig:
    config_path: str = "/etc/containerd/config.toml"
    socket: str = "/run/containerd/containerd.sock"
    version: int | None = None  # 2 or 3; None = detect from the existing config
    restart_mode: str = "signal"  # signal | systemd | none
    pod_annotations: tuple[str, ...] = ("io.katacontainers.*",)


@dataclass(frozen=True)
class KataManagerConfig:
    artifacts_dir: str = DEFAULT_ARTIFACTS_DIR
    runtime_classes: tuple[RuntimeClassConfig, ...] = ()
    containerd: ContainerdConfig = field(default_factory=ContainerdConfig)
    # RuntimeClass overhead.podFixed, e.g. {"memory": "160Mi", "cpu": "250m"}; empty = none
    overhead_pod_fixed: Mapping[str, str] = field(default_factory=dict)
    insecure_registries: tuple[str, ...] = ()  # host[:port] reachable over plain HTTP

    def runtime_class(self, name: str) -> RuntimeClassConfig | None:
        return next((rc for rc in self.runtime_classes if rc.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        """The YAML shape (camelCase keys) this config was loaded from."""
        out: dict[str, Any] = {
            "artifactsDir": self.artifacts_dir,
            "runtimeClasses": [
                {
                    "name": rc.name,
                    "nodeSelector": dict(rc.node_selector),
                    "artifacts": {"url": rc.artifacts.url, "pullSecret": rc.artifacts.pull_secret},
                }
                for rc in self.runtime_classes
            ],
            "containerd": {
                "configPath": self.containerd.config_path,
                "socket": self.containerd.socket,
                "version": self.containerd.version,
                "restartMode": self.containerd.restart_mode,
                "podAnnotations": list(self.containerd.pod_annotations),
            },
            "runtimeClassOverhead": (
                {"podFixed": dict(self.overhead_pod_fixed)} if self.overhead_pod_fixed else {}
            ),
            "insecureRegistries": list(self.insecure_registries),
        }
        return out


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


def default_config() -> KataManagerConfig:
    return KataManagerConfig(runtime_classes=default_runtime_classes())


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
    v = _Validator()
    config = v.config(data)
    if v.problems:
        raise InvalidConfig(source, v.problems)
    assert config is not None
    return config


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


class _Validator:
    """Walks the parsed YAML, collecting one message per problem."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def bad(self, where: str, message: str) -> None:
        self.problems.append(f"{where} {message}")

    def mapping(self, where: str, value: Any, allowed: tuple[str, ...]) -> dict | None:
        """The mapping at ``where`` (None -> {}), with unknown keys reported."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.bad(where, f"is {_kind(value)}; it must be a mapping")
            return None
        for key in value:
            if key not in allowed:
                self.bad(
                    f"{where}.{key}" if where else str(key),
                    f"is not a known key (known: {', '.join(allowed)})",
                )
        return value

    def string(self, where: str, value: Any, check: Callable[[str], str | None] | None = None,
               default: str | None = None) -> str | None:
        if value is None and default is not None:
            return default
        if not isinstance(value, str):
            self.bad(where, f"is {_kind(value)}; it must be a string")
            return None
        problem = check(value) if check else None
        if problem:
            self.bad(where, f"{_q(value)} {problem}")
            return None
        return value

    def config(self, data: Any) -> KataManagerConfig | None:
        top = self.mapping(
            "",
            data,
            ("artifactsDir", "runtimeClasses", "containerd", "runtimeClassOverhead",
             "insecureRegistries"),
        )
        if top is None:
            self.problems[-1] = f"the config is {_kind(data)}; it must be a mapping"
            return None
        artifacts_dir = self.string(
            "artifactsDir", top.get("artifactsDir"), _path_problem, default=DEFAULT_ARTIFACTS_DIR
        )
        if "runtimeClasses" in top:
            runtime_classes = self.runtime_classes(top["runtimeClasses"])
        else:
            runtime_classes = default_runtime_classes()
        containerd = self.containerd(top.get("containerd"))
        overhead = self.overhead(top.get("runtimeClassOverhead"))
        insecure = self.insecure_registries(top.get("insecureRegistries"))
        if self.problems:
            return None
        return KataManagerConfig(
            artifacts_dir=str(PurePosixPath(artifacts_dir)),
            runtime_classes=runtime_classes,
            containerd=containerd,
            overhead_pod_fixed=overhead,
            insecure_registries=insecure,
        )

    def runtime_classes(self, value: Any) -> tuple[RuntimeClassConfig, ...]:
        if value is None:
            return ()
        if not isinstance(value, list):
            self.bad("runtimeClasses", f"is {_kind(value)}; it must be a list")
            return ()
        out: list[RuntimeClassConfig] = []
        first_index: dict[str, int] = {}
        for i, item in enumerate(value):
            where = f"runtimeClasses[{i}]"
            entry = self.mapping(where, item, ("name", "nodeSelector", "artifacts"))
            if entry is None:
                continue
            name = self.runtime_class_name(f"{where}.name", entry.get("name"))
            if name is not None:
                if name in first_index:
                    self.bad(
                        f"{where}.name",
                        f"{_q(name)} duplicates runtimeClasses[{first_index[name]}].name; "
                        "runtime class names must be unique",
                    )
                else:
                    first_index[name] = i
            selector = self.node_selector(f"{where}.nodeSelector", entry.get("nodeSelector"))
            artifacts = self.artifacts(f"{where}.artifacts", entry.get("artifacts"))
            if name is not None and selector is not None and artifacts is not None:
                out.append(RuntimeClassConfig(name=name, artifacts=artifacts,
                                              node_selector=selector))
        return tuple(out)

    def runtime_class_name(self, where: str, value: Any) -> str | None:
        if value is None or value == "":
            self.bad(where, "is missing; every runtime class needs a name")
            return None
        return self.string(
            where,
            value,
            lambda s: None if is_dns1123_label(s) else
            "is not a DNS-1123 label (lowercase letters, digits, '-', at most 63)",
        )

    def node_selector(self, where: str, value: Any) -> dict[str, str] | None:
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.bad(where, f"is {_kind(value)}; it must be a mapping of label keys to values")
            return None
        ok = True
        for key, val in value.items():
            if not isinstance(key, str):
                self.bad(where, f"key {_q(key)} is {_kind(key)}; label keys are strings")
                ok = False
                continue
            problem = label_key_problem(key)
            if problem:
                self.bad(where, f"key {_q(key)} is not a valid label key: {problem}")
                ok = False
            entry = f"{where}[{_q(key)}]"
            if isinstance(val, bool):
                self.bad(entry, f"is a boolean; quote it (\"{str(val).lower()}\")")
                ok = False
            elif not isinstance(val, str):
                self.bad(entry, f"is {_kind(val)}; label values are strings (quote it)")
                ok = False
            elif problem := label_value_problem(val):
                self.bad(entry, f"{_q(val)} is not a valid label value: {problem}")
                ok = False
        return dict(value) if ok else None

    def artifacts(self, where: str, value: Any) -> Artifacts | None:
        if value is None:
            self.bad(where, "is missing; every runtime class needs artifacts.url")
            return None
        entry = self.mapping(where, value, ("url", "pullSecret"))
        if entry is None:
            return None
        url_where = f"{where}.url"
        url = entry.get("url")
        if url is None or url == "":
            self.bad(url_where, "is missing; give the artifacts image, e.g. "
                     f"{DEFAULT_GPU_ARTIFACTS}")
            url = None
        else:
            url = self.string(url_where, url, _url_problem)
        secret = self.string(
            f"{where}.pullSecret",
            entry.get("pullSecret"),
            lambda s: None if s == "" or is_dns1123_subdomain(s) else
            "is not a valid Secret name (DNS-1123 subdomain)",
            default="",
        )
        if url is None or secret is None:
            return None
        return Artifacts(url=url, pull_secret=secret)

    def containerd(self, value: Any) -> ContainerdConfig:
        default = ContainerdConfig()
        before = len(self.problems)
        entry = self.mapping(
            "containerd", value,
            ("configPath", "socket", "version", "restartMode", "podAnnotations"),
        )
        if entry is None:
            return default
        config_path = self.string("containerd.configPath", entry.get("configPath"),
                                  _path_problem, default=default.config_path)
        socket = self.string("containerd.socket", entry.get("socket"), _path_problem,
                             default=default.socket)
        version = entry.get("version")
        if version is not None and (isinstance(version, bool) or version not in
                                    CONTAINERD_VERSIONS):
            self.bad("containerd.version",
                     f"{_q(version)} is not a containerd config version; use 2, 3 or null (detect)")
        restart = self.string(
            "containerd.restartMode", entry.get("restartMode"),
            lambda s: None if s in RESTART_MODES else
            f"is not a restart mode; use one of {', '.join(RESTART_MODES)}",
            default=default.restart_mode,
        )
        annotations = entry.get("podAnnotations", list(default.pod_annotations))
        if annotations is None:
            annotations = []
        if not isinstance(annotations, list):
            self.bad("containerd.podAnnotations", f"is {_kind(annotations)}; it must be a list")
            annotations = []
        for i, a in enumerate(annotations):
            if not isinstance(a, str) or not a:
                self.bad(f"containerd.podAnnotations[{i}]",
                         f"{_q(a)} must be a non-empty string (an annotation glob)")
        if len(self.problems) > before:
            return default
        return ContainerdConfig(
            config_path=str(PurePosixPath(config_path)),
            socket=str(PurePosixPath(socket)),
            version=version,
            restart_mode=restart,
            pod_annotations=tuple(annotations),
        )

    def overhead(self, value: Any) -> dict[str, str]:
        entry = self.mapping("runtimeClassOverhead", value, ("podFixed",))
        if not entry:
            return {}
        fixed = entry.get("podFixed")
        if fixed is None:
            return {}
        if not isinstance(fixed, dict):
            self.bad("runtimeClassOverhead.podFixed",
                     f"is {_kind(fixed)}; it must map resource names to quantities")
            return {}
        out: dict[str, str] = {}
        for resource, qty in fixed.items():
            where = f"runtimeClassOverhead.podFixed[{_q(resource)}]"
            if not isinstance(resource, str) or label_key_problem(resource):
                self.bad("runtimeClassOverhead.podFixed",
                         f"key {_q(resource)} is not a resource name (e.g. cpu, memory)")
                continue
            if isinstance(qty, bool) or not isinstance(qty, str | int | float):
                self.bad(where, f"is {_kind(qty)}; it must be a quantity like 250m or 160Mi")
                continue
            text = str(qty)
            if not is_quantity(text):
                self.bad(where, f"{_q(text)} is not a Kubernetes quantity (e.g. 250m, 160Mi, 1)")
                continue
            out[resource] = text
        return out

    def insecure_registries(self, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        if not isinstance(value, list):
            self.bad("insecureRegistries", f"is {_kind(value)}; it must be a list of host[:port]")
            return ()
        out = []
        for i, host in enumerate(value):
            checked = self.string(
                f"insecureRegistries[{i}]", host,
                lambda s: None if _HOST.fullmatch(s) else "is not a host or host:port",
            )
            if checked:
                out.append(checked)
        return tuple(out)


def _path_problem(value: str) -> str | None:
    try:
        _check_absolute(value, "it")
    except ValueError as e:
        return f"is not a usable path: {e}"
    return None


def _url_problem(value: str) -> str | None:
    try:
        ref = parse_ref(value)
    except ConfigError as e:
        return f"is not an artifact reference: {e}"
    if isinstance(ref, LayoutRef):
        # The layout is read on the node: a relative or '..' path would depend on
        # the agent's working dir or escape the dir the operator meant.
        try:
            _check_absolute(str(ref.path), "the layout path")
        except ValueError as e:
            return f"is not an artifact reference: {e}"
    return None
