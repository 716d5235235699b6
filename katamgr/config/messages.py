"""The config's problems in an operator's words.

pydantic reports a location tuple and an error type; an operator needs the path as they
wrote it (``runtimeClasses[0].nodeSelector["a"]``), what is wrong with the value they gave,
and the fix. ``problems`` turns each of pydantic's errors into one such line by walking the
models along the error's location; ``Says`` is the metadata a field carries for messages
pydantic cannot word itself (what a missing field needs, what a wrong-typed one must be).
"""

from __future__ import annotations

import json
import typing
from collections.abc import Mapping
from types import UnionType
from typing import Annotated, Any

from pydantic import BaseModel, ValidationError

_TYPE_NAMES = {
    bool: "a boolean",
    int: "a number",
    float: "a number",
    str: "a string",
    list: "a list",
    dict: "a mapping",
    type(None): "null",
}


def quote(value: Any) -> str:
    """A value as it appears in messages: strings double-quoted, like kubectl prints them."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return repr(value)


def kind_of(value: Any) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


class Says:
    """Field metadata for messages pydantic's own errors lack: what a missing field
    needs, and what a value of the wrong type must be ("it must be a list")."""

    def __init__(self, *, missing: str | None = None, expect: str | None = None):
        self.missing = missing
        self.expect = expect



_CONTAINER_TYPES = {
    "model_type": "it must be a mapping",
    "model_attributes_type": "it must be a mapping",
    "dict_type": "it must be a mapping",
    "list_type": "it must be a list",
    "tuple_type": "it must be a list",
}


def problems(error: ValidationError, root: type[BaseModel]) -> list[str]:
    """One line per problem: the path in our style, then what is wrong and the fix."""
    return [_problem(e, root) for e in error.errors(include_url=False)]


def _problem(error: Mapping[str, Any], root: type[BaseModel]) -> str:
    loc = tuple(error["loc"])
    kind = error["type"]
    if loc and loc[-1] == "[key]":
        # A bad mapping key: reported at the mapping ("nodeSelector key "x" is ...").
        where, _, _ = _locate(loc[:-2], root)
    else:
        where, says, _ = _locate(loc, root)
    value = error.get("input")
    if kind == "value_error":
        message = str(error["ctx"]["error"])
    elif kind == "missing":
        message = "is missing" + (f"; {says.missing}" if says and says.missing else "")
    elif kind in ("extra_forbidden", "invalid_key"):  # invalid_key: not even a string
        _, _, parent = _locate(loc[:-1], root)
        known = ", ".join(_aliases(parent)) if parent else ""
        message = f"is not a known key (known: {known})"
    elif kind in _CONTAINER_TYPES:
        if not loc:
            return f"the config is {kind_of(value)}; {_CONTAINER_TYPES[kind]}"
        expect = says.expect if says and says.expect else _CONTAINER_TYPES[kind]
        message = f"is {kind_of(value)}; {expect}"
    else:
        message = error["msg"]
    return f"{where} {message}" if where else message


def _aliases(model: type[BaseModel]) -> list[str]:
    return [f.alias or name for name, f in model.model_fields.items()]


def _locate(loc: tuple[Any, ...], root: type[BaseModel]) -> tuple[str, Says | None, type[BaseModel] | None]:
    """Walk the models along ``loc``: our path for it, the message metadata of the field
    it ends at, and the model there (None where it is not a model)."""
    tp: Any = root
    path = ""
    says: Says | None = None
    for part in loc:
        tp, says = _unwrap(tp), None
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            field = next((f for n, f in tp.model_fields.items() if (f.alias or n) == part), None)
            path = f"{path}.{part}" if path else str(part)
            tp = field.annotation if field else None
            says = next((m for m in field.metadata if isinstance(m, Says)), None) if field else None
        elif typing.get_origin(tp) in (tuple, list) and isinstance(part, int):
            tp = typing.get_args(tp)[0]
            path += f"[{part}]"
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
            path += f"[{quote(part)}]"
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
