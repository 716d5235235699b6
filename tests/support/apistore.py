"""The objects the API server stand-in (``support.apiserver``) keeps, and the verbs that
read and write them, as etcd and the API server's registry do between them:

- one global resourceVersion bumped on every real write (a no-op write keeps it, as the
  real server skips a write that changes nothing), uid and creationTimestamp set here;
- GET and list (label and field selectors), POST, PUT, PATCH (merge, strategic merge and
  apply, ``support.managedfields``) and DELETE, with optimistic concurrency on PUT/PATCH
  (``metadata.resourceVersion``) and DELETE preconditions, each error the Status the real
  server answers;
- the history of changes a watch resumes from, which ``compact()`` drops as etcd
  compaction does.

The verbs and what a watch reads run with ``lock`` held (the HTTP handler holds it around
each request); the helpers a test calls take it themselves.
"""

from __future__ import annotations

import copy
import threading
import uuid
from collections.abc import Callable
from typing import Any

from support import managedfields
from support.apiobjects import (
    RESOURCES,
    ApiError,
    Resource,
    conflict_modified,
    normalise,
    not_found,
    now,
    public,
    resource_for,
    validate,
)
from support.apiselectors import field_values, parse_selector, selects

APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"

Key = tuple[str, str, str, str]  # (group, plural, namespace, name)


class ObjectStore:
    """The objects, keyed (group, plural, namespace, name), and their change history."""

    def __init__(self) -> None:
        self._objects: dict[Key, dict] = {}
        self.revision = 0
        # Reentrant so a test's hook, called under it, may use the helpers below.
        self.lock = threading.RLock()
        # Watch support: every change as (revision, type, resource, object), oldest first,
        # and a condition on the lock that wakes the streams.
        self._history: list[tuple[int, str, Resource, dict]] = []
        self.compacted = 0  # revisions up to this one are no longer in the history
        self.changed = threading.Condition(self.lock)

    # --- what tests do as another client would ---------------------------

    def seed(self, obj: dict) -> dict:
        """Store an object as if someone else had created it."""
        resource = resource_for(obj)
        ns = obj.get("metadata", {}).get("namespace", "") if resource.namespaced else ""
        with self.lock:
            return copy.deepcopy(self._create(resource, ns, copy.deepcopy(obj), "seed"))

    def get(self, plural: str, name: str, namespace: str = "") -> dict | None:
        with self.lock:
            for (_, p, ns, n), obj in self._objects.items():
                if p == plural and n == name and ns == namespace:
                    return copy.deepcopy(obj)
        return None

    def update(self, plural: str, name: str, change: Callable[[dict], None],
               namespace: str = "") -> dict:
        """Change a stored object as another client would (new resourceVersion)."""
        with self.lock:
            key = next(k for k in self._objects if k[1:] == (plural, namespace, name))
            change(self._objects[key])
            self._objects[key]["metadata"]["resourceVersion"] = self._next_revision()
            self._record_change("MODIFIED", self._resource_of(key), self._objects[key])
            return copy.deepcopy(self._objects[key])

    def remove(self, plural: str, name: str, namespace: str = "") -> None:
        with self.lock:
            key = next(k for k in self._objects if k[1:] == (plural, namespace, name))
            gone = self._objects.pop(key)
            self._next_revision()
            self._record_change("DELETED", self._resource_of(key), gone)

    def names(self, plural: str) -> list[str]:
        with self.lock:
            return sorted(n for (_, p, _, n) in self._objects if p == plural)

    def compact(self) -> None:
        """Forget the change history, as etcd compaction does: a watch that resumes from
        an earlier resourceVersion is answered 410 Expired."""
        with self.lock:
            self._history.clear()
            self.compacted = self.revision

    # --- what a watch reads (lock held) ----------------------------------

    def current(self, resource: Resource) -> list[tuple[str, dict]]:
        """The stored objects of ``resource`` as (namespace, object), in key order."""
        return [(ns, obj) for (group, plural, ns, _), obj in sorted(self._objects.items())
                if (group, plural) == (resource.group, resource.plural)]

    def changes_after(self, resource: Resource, revision: int) -> list[tuple[int, str, dict]]:
        """The changes of ``resource`` after ``revision`` as (revision, type, object)."""
        return [(rev, kind, obj) for rev, kind, r, obj in self._history
                if rev > revision and r == resource]

    def _resource_of(self, key: Key) -> Resource:
        return next(r for r in RESOURCES.values() if (r.group, r.plural) == key[:2])

    def _record_change(self, kind: str, resource: Resource, obj: dict) -> None:
        """Called with the lock held after every real change."""
        self._history.append((self.revision, kind, resource, copy.deepcopy(obj)))
        self.changed.notify_all()

    # --- the verbs (lock held) -------------------------------------------

    def handle(self, method: str, resource: Resource, ns: str, name: str, query: dict,
               content_type: str, body: Any, subresource: str = "") -> tuple[int, dict]:
        key = (resource.group, resource.plural, ns, name)
        if method == "GET":
            if name:
                return 200, public(resource, self._existing(resource, key))
            return 200, self._list(resource, ns, query)
        manager = (query.get("fieldManager") or [""])[0]
        if method == "POST" and not name:
            obj = self._decode(resource, body, ns)
            return 201, public(resource, self._create(resource, ns, obj, manager or "unknown"))
        if not name:
            raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed on a collection")
        if method == "PUT":
            obj = self._decode(resource, body, ns, name)
            return 200, public(resource, self._update(resource, key, obj, manager or "unknown"))
        if method == "PATCH":
            return self._patch(resource, key, query, content_type, body, manager, subresource)
        if method == "DELETE":
            return 200, self._delete(resource, key, body)
        raise ApiError(405, "MethodNotAllowed", f"method {method} is not supported")

    def _existing(self, resource: Resource, key: Key) -> dict:
        obj = self._objects.get(key)
        if obj is None:
            raise not_found(resource, key[3])
        return obj

    def _list(self, resource: Resource, ns: str, query: dict) -> dict:
        selector = parse_selector((query.get("labelSelector") or [""])[0])
        fields = parse_selector((query.get("fieldSelector") or [""])[0])
        items = []
        for (group, plural, obj_ns, name), obj in sorted(self._objects.items()):
            if (group, plural) != (resource.group, resource.plural) or (ns and obj_ns != ns):
                continue
            labels = obj.get("metadata", {}).get("labels") or {}
            values = field_values(resource, obj, name, obj_ns, fields)
            if selects(selector, labels) and selects(fields, values):
                # Like the real server, list items carry no kind/apiVersion.
                items.append(copy.deepcopy(obj))
        return {"kind": f"{resource.kind}List", "apiVersion": resource.api_version,
                "metadata": {"resourceVersion": str(self.revision)}, "items": items}

    def _decode(self, resource: Resource, body: Any, ns: str, name: str = "") -> dict:
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the request body is not an object")
        if body.get("kind") not in (None, resource.kind) or body.get("apiVersion") not in (
                None, resource.api_version):
            raise ApiError(400, "BadRequest",
                           f"the body is {body.get('apiVersion')}/{body.get('kind')}, "
                           f"expected {resource.api_version}/{resource.kind}")
        obj = {k: v for k, v in body.items() if k not in ("kind", "apiVersion")}
        meta = obj.setdefault("metadata", {}) or {}
        obj["metadata"] = meta
        if name and meta.get("name", name) != name:
            raise ApiError(400, "BadRequest",
                           f"the name of the object ({meta.get('name')}) does not match the "
                           f"name on the URL ({name})")
        if name:
            meta["name"] = name
        if resource.namespaced:
            if meta.get("namespace", ns) != ns:
                raise ApiError(400, "BadRequest", "the namespace of the provided object does "
                               "not match the namespace sent on the request")
            meta["namespace"] = ns
        return obj

    def _next_revision(self) -> str:
        self.revision += 1
        return str(self.revision)

    def _create(self, resource: Resource, ns: str, obj: dict, manager: str,
                operation: str = "Update") -> dict:
        meta = obj.setdefault("metadata", {})
        obj.pop("kind", None)
        obj.pop("apiVersion", None)
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        name = meta.get("name")
        if not name:
            raise ApiError(422, "Invalid", f"{resource.kind} \"\" is invalid: metadata.name: "
                           "Required value: name or generateName is required")
        key = (resource.group, resource.plural, ns, name)
        if key in self._objects:
            raise ApiError(409, "AlreadyExists",
                           f"{resource.qualified} \"{name}\" already exists",
                           {"name": name, "group": resource.group, "kind": resource.plural})
        if ns:
            meta["namespace"] = ns
        normalise(resource, obj)
        validate(resource, obj, None)
        meta.pop("resourceVersion", None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now())
        leaves = managedfields.user_leaves(obj)
        meta["managedFields"] = [managedfields.managed_entry(manager, operation, leaves,
                                                             resource)]
        meta["resourceVersion"] = self._next_revision()
        self._objects[key] = obj
        self._record_change("ADDED", resource, obj)
        return obj

    def _update(self, resource: Resource, key: Key, obj: dict, manager: str) -> dict:
        live = self._existing(resource, key)
        rv = obj["metadata"].get("resourceVersion")
        if rv and rv != live["metadata"]["resourceVersion"]:
            raise conflict_modified(resource, key[3])
        normalise(resource, obj)
        for system in ("uid", "creationTimestamp", "managedFields"):
            if system in live["metadata"]:
                obj["metadata"][system] = live["metadata"][system]
        managedfields.take_ownership(obj, manager, "Update",
                                     managedfields.changed_leaves(live, obj), resource)
        return self._commit(resource, key, live, obj)

    def _commit(self, resource: Resource, key: Key, live: dict | None, obj: dict) -> dict:
        validate(resource, obj, live)
        if live is not None and _comparable(live) == _comparable(obj):
            return live  # a no-op write: the real server keeps the resourceVersion
        obj["metadata"]["resourceVersion"] = self._next_revision()
        self._objects[key] = obj
        self._record_change("MODIFIED", resource, obj)
        return obj

    def _patch(self, resource: Resource, key: Key, query: dict, content_type: str,
               body: Any, manager: str, subresource: str = "") -> tuple[int, dict]:
        force = (query.get("force") or [""])[0] == "true"
        if content_type == APPLY:
            if not manager:
                raise ApiError(400, "BadRequest", "PatchOptions.meta.k8s.io \"\" is invalid: "
                               "fieldManager: Required value: is required for apply patch")
            obj = self._decode(resource, body, key[2], key[3])
            if "kind" not in body or "apiVersion" not in body:
                raise ApiError(400, "BadRequest", "apply patches must set apiVersion and kind")
            live = self._objects.get(key)
            if live is None:
                return 201, public(resource, self._create(resource, key[2], obj, manager,
                                                          "Apply"))
            return 200, public(resource, self._apply(resource, key, live, obj, manager, force))
        if force:
            raise ApiError(400, "BadRequest", "force: Invalid value: true: may not be "
                           "specified for non-apply patch")
        if content_type not in (MERGE, STRATEGIC):
            raise ApiError(415, "UnsupportedMediaType",
                           f"the body of the request was in an unknown format - accepted media "
                           f"types include: {APPLY}, {MERGE}, {STRATEGIC}")
        live = self._existing(resource, key)
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "a merge patch must be an object")
        rv = (body.get("metadata") or {}).get("resourceVersion")
        if rv and rv != live["metadata"]["resourceVersion"]:
            raise conflict_modified(resource, key[3])
        obj = _merge_patch(copy.deepcopy(live), body, content_type == STRATEGIC)
        if resource.plural == "nodes":
            # The Node's strategies (pkg/registry/core/node/strategy.go): an update of the
            # main resource keeps the stored status, one of nodes/status takes only the status.
            obj = {**live, "status": obj.get("status")} if subresource == "status" else \
                {**obj, "status": live.get("status")}
            obj = {k: v for k, v in obj.items() if v is not None}
        managedfields.take_ownership(obj, manager or "unknown", "Update",
                                     managedfields.changed_leaves(live, obj), resource)
        normalise(resource, obj)
        return 200, public(resource, self._commit(resource, key, live, obj))

    def _apply(self, resource: Resource, key: Key, live: dict, applied: dict, manager: str,
               force: bool) -> dict:
        obj = managedfields.apply(resource, key[3], live, applied, manager, force)
        normalise(resource, obj)
        managedfields.take_ownership(obj, manager, "Apply",
                                     set(managedfields.user_leaves(applied)), resource,
                                     replace=True)
        return self._commit(resource, key, live, obj)

    def _delete(self, resource: Resource, key: Key, body: Any) -> dict:
        live = self._existing(resource, key)
        pre = (body or {}).get("preconditions") or {} if isinstance(body, dict) else {}
        for field, have in (("resourceVersion", live["metadata"]["resourceVersion"]),
                            ("uid", live["metadata"]["uid"])):
            if pre.get(field) and pre[field] != have:
                raise ApiError(409, "Conflict",
                               f"Operation cannot be fulfilled on {resource.qualified} "
                               f"\"{key[3]}\": Precondition failed: {field[0].upper()}"
                               f"{field[1:]} in precondition: {pre[field]}, {field[0].upper()}"
                               f"{field[1:]} in object meta: {have}",
                               {"name": key[3], "group": resource.group,
                                "kind": resource.plural})
        del self._objects[key]
        self._next_revision()
        self._record_change("DELETED", resource, live)
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                "details": {"name": key[3], "group": resource.group, "kind": resource.plural,
                            "uid": live["metadata"]["uid"]}}


def _comparable(obj: dict) -> dict:
    """An object less what every write changes, to tell a no-op write."""
    out = copy.deepcopy(obj)
    out["metadata"].pop("resourceVersion", None)
    for entry in out["metadata"].get("managedFields") or []:
        entry.pop("time", None)
    return out


# Lists a strategic merge patch merges by a key (patchMergeKey in k8s.io/api core/v1
# types.go: NodeStatus.Conditions and PodStatus.Conditions by type); every other list is replaced.
MERGE_KEYS = {"conditions": "type"}


def _merge_patch(target: Any, patch: Any, strategic: bool = False) -> Any:
    """RFC 7386 JSON merge patch; ``strategic``: lists in MERGE_KEYS merged item by item."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if not isinstance(target, dict):
        target = {}
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif strategic and k in MERGE_KEYS and isinstance(v, list) and isinstance(target.get(k), list):
            key = MERGE_KEYS[k]
            merged = [copy.deepcopy(item) for item in target[k]]
            for item in v:
                at = next((i for i, have in enumerate(merged) if have.get(key) == item.get(key)), None)
                if at is None:
                    merged.append(copy.deepcopy(item))
                else:
                    merged[at] = _merge_patch(merged[at], item, strategic)
            target[k] = merged
        else:
            target[k] = _merge_patch(target.get(k), v, strategic)
    return target
