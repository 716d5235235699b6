"""Label and field selectors for the API server stand-in (``support.apiserver``), as a list
and a watch take them (``labelSelector`` / ``fieldSelector``): equality, set-based ``in`` /
``notin`` and existence requirements (k8s.io/apimachinery ``pkg/labels/selector.go``), and
the field labels each kind offers, any other refused 400 as the real server refuses it.
"""

from __future__ import annotations

import re

from support import resourceapi
from support.apiobjects import ApiError, Resource

# Field selectors a kind offers besides metadata.name and metadata.namespace; any other
# field label is refused, as the real server refuses it.
SELECTABLE_FIELDS = {"ResourceSlice": resourceapi.slice_fields, "Pod": lambda obj: pod_fields(obj)}


def pod_fields(obj: dict) -> dict[str, str]:
    """Some of a pod's field labels (k8s.io/kubernetes pkg/registry/core/pod/strategy.go,
    ``PodToSelectableFields``): the node it is bound to and its phase."""
    return {"spec.nodeName": (obj.get("spec") or {}).get("nodeName") or "",
            "status.phase": (obj.get("status") or {}).get("phase") or ""}

Requirement = tuple[str, str, set[str]]

_REQUIREMENT = re.compile(
    r"\s*(?P<neg>!)?\s*(?P<key>[A-Za-z0-9_./-]+)\s*"
    r"(?:(?P<op>==|=|!=|\s+in\s+|\s+notin\s+)\s*(?P<value>\([^)]*\)|[A-Za-z0-9_.-]*))?\s*"
)


def parse_selector(text: str) -> list[Requirement]:
    """Requirements of a label/field selector: (op, key, values)."""
    requirements = []
    parts = re.findall(r"(?:[^,(]|\([^)]*\))+", text)
    for part in parts:
        m = _REQUIREMENT.fullmatch(part)
        if not m:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {part!r}")
        op = (m["op"] or "").strip()
        raw = m["value"] or ""
        values = {v.strip() for v in raw.strip("()").split(",")} if raw.startswith("(") else {raw}
        if m["neg"]:
            requirements.append(("!", m["key"], set()))
        elif not op:
            requirements.append(("exists", m["key"], set()))
        else:
            requirements.append(({"==": "=", "=": "=", "!=": "!=", "in": "in",
                                  "notin": "notin"}[op], m["key"], values))
    return requirements


def selects(requirements: list[Requirement], labels: dict) -> bool:
    for op, key, values in requirements:
        have = labels.get(key)
        if op == "exists" and have is None:
            return False
        if op == "!" and have is not None:
            return False
        if op in ("=", "in") and have not in values:
            return False
        if op in ("!=", "notin") and have in values:
            return False
    return True


def field_values(resource: Resource, obj: dict, name: str, ns: str,
                 fields: list[Requirement]) -> dict[str, str]:
    """The field labels of an object a field selector matches against."""
    values = {"metadata.name": name, "metadata.namespace": ns}
    extra = SELECTABLE_FIELDS.get(resource.kind)
    if extra is not None:
        values.update(extra(obj))
    for _, key, _ in fields:
        if key not in values:
            raise ApiError(400, "BadRequest", f'field label not supported: {key}')
    return values

