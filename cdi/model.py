"""Typed model of a CDI spec, with exact JSON-name round trips.

``X.from_dict(d)`` accepts the decoded JSON/YAML document and rejects unknown fields and
wrong types with a SpecError naming the field path; ``x.to_dict()`` gives it back using
the spec's JSON field names. Optional scalars are ``None`` when absent and are omitted on
output, as are empty lists, maps and spec-level edits; a value that was present (even
``0``, ``False`` or ``""``) is written back, so ``from_dict(d).to_dict() == d`` for every
document without empty lists or maps. Presence matters for a few fields: ``intelRdt``
(even empty) needs cdiVersion 0.7.0, and ``intelRdt.schemata`` (even empty) needs 1.1.0.

The model only checks structure; the CDI rules live in ``cdi.validate``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from cdi.errors import SpecError


def _json(name: str, *, required: bool = False, **kwargs: Any) -> Any:
    return field(metadata={"json": name, "required": required}, **kwargs)


class _Codec:
    """Shared to_dict/from_dict driven by the dataclass fields and their type hints."""

    _hints: ClassVar[dict[type, dict[str, Any]]] = {}

    @classmethod
    def _fields(cls) -> list[tuple[dataclasses.Field, Any]]:
        hints = _Codec._hints.get(cls)
        if hints is None:
            hints = typing.get_type_hints(cls)
            _Codec._hints[cls] = hints
        return [(f, hints[f.name]) for f in dataclasses.fields(cls)]  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, data: Any, path: str = "") -> Self:
        """Build from a decoded document; ``path`` prefixes field paths in errors."""
        if not isinstance(data, dict):
            subject = "" if path else "the document "
            raise SpecError(path, f"{subject}must be a mapping, not {_type_name(data)}")
        known = {f.metadata["json"]: (f, hint) for f, hint in cls._fields()}
        for key in data:
            if key not in known:
                known_list = ", ".join(known)
                if not isinstance(key, str):
                    raise SpecError(path, f"key {key!r} is not a known field ({known_list})")
                raise SpecError(_join(path, key), f"is not a known field here ({known_list})")
        kwargs = {}
        for json_name, (f, hint) in known.items():
            where = _join(path, json_name)
            if json_name not in data or (data[json_name] is None and not f.metadata["required"]):
                if f.metadata["required"]:
                    raise SpecError(where, "is required")
                continue
            kwargs[f.name] = _decode(hint, data[json_name], where)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The document with the spec's JSON field names, absent and empty fields left out."""
        out: dict[str, Any] = {}
        for f, hint in self._fields():
            value = getattr(self, f.name)
            if value is None:
                continue
            encoded = _encode(value)
            omittable = not f.metadata["required"] and not _is_optional(hint)
            if omittable and isinstance(encoded, list | dict) and not encoded:
                continue  # empty list, map or spec-level edits, like the reference's omitempty
            out[f.metadata["json"]] = encoded
        return out


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping"}.get(type(value), type(value).__name__)


def _is_optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in \
        typing.get_args(hint)


def _decode(hint: Any, value: Any, path: str) -> Any:
    if _is_optional(hint):
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return _decode(inner, value, path)
    origin = typing.get_origin(hint)
    if origin is list:
        if not isinstance(value, list):
            raise SpecError(path, f"must be a list, not {_type_name(value)}")
        (item,) = typing.get_args(hint)
        return [_decode(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise SpecError(path, f"must be a mapping, not {_type_name(value)}")
        for k, v in value.items():
            if not isinstance(k, str):
                raise SpecError(path, f"key {k!r} must be a string, not {_type_name(k)}")
            if not isinstance(v, str):
                raise SpecError(_join(path, k), f"must be a string, not {_type_name(v)}")
        return dict(value)
    if isinstance(hint, type) and issubclass(hint, _Codec):
        return hint.from_dict(value, path)
    if hint is bool:
        if not isinstance(value, bool):
            raise SpecError(path, f"must be a boolean, not {_type_name(value)}")
        return value
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise SpecError(path, f"must be an integer, not {_type_name(value)}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise SpecError(path, f"must be a string, not {_type_name(value)}")
        return value
    raise TypeError(f"unsupported field type {hint!r}")  # a bug in this module


def _encode(value: Any) -> Any:
    if isinstance(value, _Codec):
        return value.to_dict()
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return dict(value)
    return value


@dataclass(kw_only=True)
class DeviceNode(_Codec):
    """A device node to create in the container (``path``) from the host (``hostPath``)."""

    path: str = _json("path", required=True)
    host_path: str | None = _json("hostPath", default=None)
    type: str | None = _json("type", default=None)
    major: int | None = _json("major", default=None)
    minor: int | None = _json("minor", default=None)
    file_mode: int | None = _json("fileMode", default=None)
    permissions: str | None = _json("permissions", default=None)
    uid: int | None = _json("uid", default=None)
    gid: int | None = _json("gid", default=None)


@dataclass(kw_only=True)
class Mount(_Codec):
    host_path: str = _json("hostPath", required=True)
    container_path: str = _json("containerPath", required=True)
    type: str | None = _json("type", default=None)
    options: list[str] = _json("options", default_factory=list)


@dataclass(kw_only=True)
class Hook(_Codec):
    hook_name: str = _json("hookName", required=True)
    path: str = _json("path", required=True)
    args: list[str] = _json("args", default_factory=list)
    env: list[str] = _json("env", default_factory=list)
    timeout: int | None = _json("timeout", default=None)


@dataclass(kw_only=True)
class IntelRdt(_Codec):
    """Intel RDT class of service. ``enableCMT``/``enableMBM`` exist before cdiVersion
    1.1.0; ``schemata``/``enableMonitoring`` from 1.1.0."""

    clos_id: str | None = _json("closID", default=None)
    l3_cache_schema: str | None = _json("l3CacheSchema", default=None)
    mem_bw_schema: str | None = _json("memBwSchema", default=None)
    schemata: list[str] | None = _json("schemata", default=None)
    enable_monitoring: bool | None = _json("enableMonitoring", default=None)
    enable_cmt: bool | None = _json("enableCMT", default=None)
    enable_mbm: bool | None = _json("enableMBM", default=None)


@dataclass(kw_only=True)
class NetDevice(_Codec):
    """A host network interface moved into the container (cdiVersion 1.1.0)."""

    host_interface_name: str = _json("hostInterfaceName", required=True)
    name: str = _json("name", required=True)


@dataclass(kw_only=True)
class ContainerEdits(_Codec):
    env: list[str] = _json("env", default_factory=list)
    device_nodes: list[DeviceNode] = _json("deviceNodes", default_factory=list)
    net_devices: list[NetDevice] = _json("netDevices", default_factory=list)
    hooks: list[Hook] = _json("hooks", default_factory=list)
    mounts: list[Mount] = _json("mounts", default_factory=list)
    intel_rdt: IntelRdt | None = _json("intelRdt", default=None)
    additional_gids: list[int] = _json("additionalGids", default_factory=list)

    def is_empty(self) -> bool:
        return not (self.env or self.device_nodes or self.net_devices or self.hooks
                    or self.mounts or self.additional_gids or self.intel_rdt is not None)


@dataclass(kw_only=True)
class Device(_Codec):
    name: str = _json("name", required=True)
    annotations: dict[str, str] = _json("annotations", default_factory=dict)
    container_edits: ContainerEdits = _json("containerEdits", required=True,
                                            default_factory=ContainerEdits)


@dataclass(kw_only=True)
class Spec(_Codec):
    """One CDI spec document: the devices of one ``kind`` (``vendor/class``)."""

    cdi_version: str = _json("cdiVersion", required=True)
    kind: str = _json("kind", required=True)
    annotations: dict[str, str] = _json("annotations", default_factory=dict)
    devices: list[Device] = _json("devices", required=True, default_factory=list)
    container_edits: ContainerEdits = _json("containerEdits", default_factory=ContainerEdits)

    @property
    def vendor(self) -> str:
        return self.kind.partition("/")[0]

    @property
    def class_(self) -> str:
        return self.kind.partition("/")[2]

    def device(self, name: str) -> Device | None:
        return next((d for d in self.devices if d.name == name), None)
