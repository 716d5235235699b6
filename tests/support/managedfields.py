"""Field ownership for the API server stand-in (``support.apiserver``): who set which field,
in ``metadata.managedFields`` (FieldsV1), and server-side apply's merge.

The real server keeps this in k8s.io/apiserver ``pkg/endpoints/handlers/fieldmanager`` over
sigs.k8s.io/structured-merge-diff; the stand-in follows it where our code can notice: every
write gives the fields it changed to its fieldManager (operation Update, or Apply for an
apply patch); an apply conflicts with other managers over a field it would change unless
forced, and removes the fields its manager applied before and stopped sending. Lists are
atomic (a list is one field), maps are walked to their leaves.
"""

from __future__ import annotations

import copy
from typing import Any

from support.apiobjects import ApiError, Resource, now

FieldPath = tuple[str, ...]

# Metadata the server sets or that names the object: never a field a manager owns.
_SYSTEM_META = ("name", "namespace", "uid", "resourceVersion", "creationTimestamp",
                "managedFields", "generation", "generateName")


def user_leaves(obj: dict) -> dict[FieldPath, Any]:
    """Leaf paths of the fields a user sets (system metadata excluded; lists atomic)."""
    out: dict[FieldPath, Any] = {}

    def walk(value: Any, prefix: FieldPath) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                if prefix == ("metadata",) and k in _SYSTEM_META:
                    continue
                if not prefix and k in ("kind", "apiVersion"):
                    continue
                walk(v, (*prefix, k))
        elif prefix:
            out[prefix] = value

    walk(obj, ())
    return out


def changed_leaves(old: dict, new: dict) -> set[FieldPath]:
    """The user fields ``new`` sets to a value ``old`` does not have."""
    before = user_leaves(old)
    return {p for p, v in user_leaves(new).items() if before.get(p) != v}


def _encode_fields(paths: set[FieldPath]) -> dict:
    root: dict = {}
    for path in sorted(paths):
        node = root
        for depth, key in enumerate(path):
            node = node.setdefault(f"f:{key}", {})
            if depth < len(path) - 1:
                node.setdefault(".", {})
    return root


def _decode_fields(fields: dict, prefix: FieldPath = ()) -> set[FieldPath]:
    out: set[FieldPath] = set()
    children = {k: v for k, v in fields.items() if k.startswith("f:")}
    if not children and prefix:
        out.add(prefix)
    for k, v in children.items():
        out |= _decode_fields(v or {}, (*prefix, k[2:]))
    return out


def managed_entry(manager: str, operation: str, paths, resource: Resource) -> dict:
    return {"manager": manager, "operation": operation, "apiVersion": resource.api_version,
            "time": now(), "fieldsType": "FieldsV1", "fieldsV1": _encode_fields(set(paths))}


def take_ownership(obj: dict, manager: str, operation: str, paths: set[FieldPath],
                   resource: Resource, replace: bool = False) -> None:
    """Give ``paths`` to manager/operation, taking them from everyone else."""
    entries = []
    mine: set[FieldPath] = set()
    present = set(user_leaves(obj))
    for entry in obj["metadata"].get("managedFields") or []:
        owned = _decode_fields(entry.get("fieldsV1") or {}) & present
        if entry["manager"] == manager and entry["operation"] == operation:
            mine = set() if replace else owned
            continue
        owned -= paths
        if owned:
            entries.append({**entry, "fieldsV1": _encode_fields(owned)})
    mine |= paths
    if mine:
        entries.append(managed_entry(manager, operation, mine, resource))
    obj["metadata"]["managedFields"] = entries


def apply(resource: Resource, name: str, live: dict, applied: dict, manager: str,
          force: bool) -> dict:
    """The object an apply patch from ``manager`` makes of ``live`` (its managedFields
    still live's: the caller gives ``manager`` the applied fields once the object is
    defaulted); 409 Conflict naming each field another manager set otherwise, unless forced."""
    new_leaves = user_leaves(applied)
    entries = live["metadata"].get("managedFields") or []
    conflicts = []
    live_leaves = user_leaves(live)
    for entry in entries:
        if entry["manager"] == manager and entry["operation"] == "Apply":
            continue
        for path in _decode_fields(entry.get("fieldsV1") or {}):
            if path in new_leaves and live_leaves.get(path) != new_leaves[path]:
                conflicts.append((entry["manager"], path))
    if conflicts and not force:
        listing = "; ".join(f'conflict with "{m}": .{".".join(p)}' for m, p in conflicts)
        raise ApiError(409, "Conflict",
                       f"Apply failed with {len(conflicts)} conflict(s): {listing}",
                       {"name": name, "group": resource.group, "kind": resource.plural})
    previously = set()
    for entry in entries:
        if entry["manager"] == manager and entry["operation"] == "Apply":
            previously = _decode_fields(entry.get("fieldsV1") or {})
    others = set()
    for entry in entries:
        if not (entry["manager"] == manager and entry["operation"] == "Apply"):
            others |= _decode_fields(entry.get("fieldsV1") or {}) - set(new_leaves)
    obj = copy.deepcopy(live)
    for path in previously - set(new_leaves) - others:
        _remove_path(obj, path)
    for path, value in new_leaves.items():
        _set_path(obj, path, copy.deepcopy(value))
    return obj


def _set_path(obj: dict, path: FieldPath, value: Any) -> None:
    for key in path[:-1]:
        if not isinstance(obj.get(key), dict):
            obj[key] = {}
        obj = obj[key]
    obj[path[-1]] = value


def _remove_path(obj: dict, path: FieldPath) -> None:
    parents = []
    for key in path[:-1]:
        if not isinstance(obj.get(key), dict):
            return
        parents.append((obj, key))
        obj = obj[key]
    obj.pop(path[-1], None)
    for parent, key in reversed(parents):  # prune maps left empty
        if parent[key] == {}:
            del parent[key]
