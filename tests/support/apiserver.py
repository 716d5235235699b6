"""A small, faithful stand-in for the Kubernetes API server.

No kube-apiserver runs on our machines, so the official client talks HTTP to
this one instead. It follows the real server where our code can notice:

- URL layout (``/api/v1/...``, ``/apis/<group>/<version>/...``, namespaced or
  cluster scoped) for RuntimeClasses (node.k8s.io/v1), Secrets, Nodes, Events
  and Pods (core v1, stored as given), and ResourceSlices, ResourceClaims and DeviceClasses
  (resource.k8s.io/v1, with the ResourceSlice rules of ``support.resourceapi``);
- a global resourceVersion bumped on every real write (a no-op write keeps it),
  uid and creationTimestamp set by the server;
- errors as ``Status`` objects with reason and code: 404 NotFound,
  409 AlreadyExists / Conflict, 422 Invalid, 400 BadRequest, 401, 415;
- server-side apply (``application/apply-patch+yaml``): fieldManager
  required, create if absent, field ownership in ``metadata.managedFields``
  (FieldsV1), conflicts with other managers unless ``force=true``, removal of
  fields the applier owned and stopped sending; lists are atomic;
- merge patch and strategic merge patch (maps merged, lists replaced, null
  deletes), optimistic concurrency on PUT/PATCH and delete preconditions;
- RuntimeClass ``handler`` validation and immutability;
- watch (``?watch=true`` on a collection, as ``kubectl get -w`` and client-go's
  reflectors use it): a chunked stream of JSON lines ``{"type": ADDED|MODIFIED|DELETED,
  "object": ...}`` for the objects the label and field selectors pick, starting after
  ``resourceVersion`` (absent or "0": the current objects as ADDED first), ended by the
  server after ``timeoutSeconds``; a ``resourceVersion`` older than the history kept
  (``compact()`` drops it, as etcd compaction does) answers one ERROR event with a 410
  ``Expired`` Status, as the watch cache does (k8s.io/apiserver ``pkg/storage/cacher``).

Every request is recorded (``requests`` / ``writes()``) so tests can assert what
was written, and how often.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml
from kubernetes.client import ApiClient, Configuration

from support import resourceapi

APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural


RESOURCES = {
    (r.group, r.version, r.plural): r
    for r in (
        Resource("node.k8s.io", "v1", "runtimeclasses", "RuntimeClass", False),
        Resource("", "v1", "secrets", "Secret", True),
        Resource("", "v1", "nodes", "Node", False),
        Resource("", "v1", "events", "Event", True),
        Resource("", "v1", "pods", "Pod", True),
        Resource("resource.k8s.io", "v1", "resourceslices", "ResourceSlice", False),
        Resource("resource.k8s.io", "v1", "resourceclaims", "ResourceClaim", True),
        Resource("resource.k8s.io", "v1", "deviceclasses", "DeviceClass", False),
    )
}

# Field selectors a kind offers besides metadata.name and metadata.namespace; any other
# field label is refused, as the real server refuses it.
SELECTABLE_FIELDS = {"ResourceSlice": resourceapi.slice_fields}


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str
    body: Any
    status: int


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict:
        out = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            out["details"] = self.details
        return out


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeApiServer:
    """In-memory API server on 127.0.0.1; use as a context manager."""

    def __init__(self, token: str | None = None):
        self.token = token
        self.requests: list[RecordedRequest] = []
        self._objects: dict[tuple[str, str, str, str], dict] = {}  # (group, plural, ns, name)
        self._revision = 0
        # Reentrant so an on_request hook may use the helpers below.
        self._lock = threading.RLock()
        # Called as on_request(method, path) under the lock, before the request is
        # served: lets a test change the world at an exact moment (races).
        self.on_request: Callable[[str, str], None] | None = None
        self._httpd: ThreadingHTTPServer | None = None
        self._port = 0  # chosen at the first start, kept for a restart
        self._thread: threading.Thread | None = None
        # Watch support: every change as (revision, type, resource, object), oldest first,
        # and a condition on the lock that wakes the streams.
        self._history: list[tuple[int, str, Resource, dict]] = []
        self._compacted = 0  # revisions up to this one are no longer in the history
        self._changed = threading.Condition(self._lock)
        self._stopping = False
        # Set by a test: watch requests are refused with this HTTP status (403: RBAC lacks
        # the watch verb), as a server that cannot watch would.
        self.refuse_watch: int | None = None
        # Writes still to be refused after a start(warming=N), as a just-started API server's
        # admission plugins refuse them until their informers synced.
        self._warming = 0

    # --- lifecycle -------------------------------------------------------

    def start(self, warming: int = 0) -> FakeApiServer:
        """Serve; again on the same port after ``stop()`` (an API server restarted: its
        objects kept, as etcd keeps them). ``warming``: the first that many writes are
        refused 403 "not yet ready to handle request", as kube-apiserver's admission plugins
        refuse them until their informers have synced (k8s.io/apiserver
        admission/plugin/namespace/lifecycle/admission.go)."""
        server = self
        self._warming = warming

        class Handler(_Handler):
            api = server

        with self._lock:
            self._stopping = False
        self._httpd = ThreadingHTTPServer(("127.0.0.1", self._port), Handler)
        self._port = self._httpd.server_address[1]
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,),
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        if self._httpd:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._httpd, "server not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def client(self) -> ApiClient:
        configuration = Configuration(host=self.url)
        if self.token:
            configuration.api_key = {"BearerToken": self.token}
            configuration.api_key_prefix = {"BearerToken": "Bearer"}
        return ApiClient(configuration)

    def write_kubeconfig(self, path: Path) -> Path:
        user: dict[str, Any] = {"token": self.token} if self.token else {}
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "stand-in", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": user}],
            "contexts": [{"name": "stand-in",
                          "context": {"cluster": "stand-in", "user": "tester"}}],
            "current-context": "stand-in",
        }))
        return path

    # --- test helpers ----------------------------------------------------

    def seed(self, obj: dict) -> dict:
        """Store an object as if someone else had created it (not logged)."""
        resource = self._resource_for(obj)
        ns = obj.get("metadata", {}).get("namespace", "") if resource.namespaced else ""
        with self._lock:
            return copy.deepcopy(self._create(resource, ns, copy.deepcopy(obj), "seed"))

    def get(self, plural: str, name: str, namespace: str = "") -> dict | None:
        with self._lock:
            for (_, p, ns, n), obj in self._objects.items():
                if p == plural and n == name and ns == namespace:
                    return copy.deepcopy(obj)
        return None

    def update(self, plural: str, name: str, change: Callable[[dict], None],
               namespace: str = "") -> dict:
        """Change a stored object as another client would (new resourceVersion)."""
        with self._lock:
            key = next(k for k in self._objects if k[1:] == (plural, namespace, name))
            change(self._objects[key])
            self._objects[key]["metadata"]["resourceVersion"] = self._next_revision()
            self._record_change("MODIFIED", self._resource_of(key), self._objects[key])
            return copy.deepcopy(self._objects[key])

    def remove(self, plural: str, name: str, namespace: str = "") -> None:
        with self._lock:
            key = next(k for k in self._objects if k[1:] == (plural, namespace, name))
            gone = self._objects.pop(key)
            self._next_revision()
            self._record_change("DELETED", self._resource_of(key), gone)

    def names(self, plural: str) -> list[str]:
        with self._lock:
            return sorted(n for (_, p, _, n) in self._objects if p == plural)

    def compact(self) -> None:
        """Forget the change history, as etcd compaction does: a watch that resumes from
        an earlier resourceVersion is answered 410 Expired."""
        with self._lock:
            self._history.clear()
            self._compacted = self._revision

    def watches(self, plural: str) -> list[RecordedRequest]:
        """The watch requests made on a collection."""
        return [r for r in self.requests if r.method == "GET" and r.path.endswith("/" + plural)
                and _is_watch(r.query)]

    def writes(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.method not in ("GET", "HEAD")]

    def clear_log(self) -> None:
        self.requests.clear()

    def _resource_of(self, key: tuple) -> Resource:
        return next(r for r in RESOURCES.values() if (r.group, r.plural) == key[:2])

    def _record_change(self, kind: str, resource: Resource, obj: dict) -> None:
        """Called with the lock held after every real change."""
        self._history.append((self._revision, kind, resource, copy.deepcopy(obj)))
        self._changed.notify_all()

    def _resource_for(self, obj: dict) -> Resource:
        group, _, version = obj["apiVersion"].rpartition("/")
        for r in RESOURCES.values():
            if r.group == group and r.version == version and r.kind == obj["kind"]:
                return r
        raise KeyError(f"stand-in does not serve {obj['apiVersion']} {obj['kind']}")

    # --- request handling (called with the lock held) -------------------

    def handle(self, method: str, path: str, query: dict, content_type: str, body: Any):
        resource, ns, name = self._route(path)
        key = (resource.group, resource.plural, ns, name)
        if method != "GET" and self._warming > 0:
            self._warming -= 1
            raise ApiError(403, "Forbidden", f"{resource.plural} is forbidden: not yet ready to handle request")
        if method == "GET":
            if name:
                return 200, self._public(resource, self._existing(resource, key))
            return 200, self._list(resource, ns, query)
        manager = (query.get("fieldManager") or [""])[0]
        if method == "POST" and not name:
            obj = self._decode(resource, body, ns)
            return 201, self._public(resource, self._create(resource, ns, obj,
                                                            manager or "unknown"))
        if not name:
            raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed on a collection")
        if method == "PUT":
            obj = self._decode(resource, body, ns, name)
            return 200, self._public(resource, self._update(resource, key, obj,
                                                            manager or "unknown"))
        if method == "PATCH":
            return self._patch(resource, key, query, content_type, body, manager)
        if method == "DELETE":
            return 200, self._delete(resource, key, body)
        raise ApiError(405, "MethodNotAllowed", f"method {method} is not supported")

    def _route(self, path: str) -> tuple[Resource, str, str]:
        parts = [p for p in path.split("/") if p]
        if parts[:1] == ["api"] and len(parts) >= 2:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 3:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        ns = ""
        if len(rest) >= 3 and rest[0] == "namespaces":
            ns, rest = rest[1], rest[2:]
        resource = RESOURCES.get((group, version, rest[0] if rest else ""))
        if resource is None or len(rest) > 2 or bool(ns) != resource.namespaced:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return resource, ns, rest[1] if len(rest) == 2 else ""

    def _existing(self, resource: Resource, key: tuple) -> dict:
        obj = self._objects.get(key)
        if obj is None:
            raise _not_found(resource, key[3])
        return obj

    def _public(self, resource: Resource, obj: dict) -> dict:
        return {"kind": resource.kind, "apiVersion": resource.api_version,
                **copy.deepcopy(obj)}

    def _list(self, resource: Resource, ns: str, query: dict) -> dict:
        selector = _parse_selector((query.get("labelSelector") or [""])[0])
        fields = _parse_selector((query.get("fieldSelector") or [""])[0])
        items = []
        for (group, plural, obj_ns, name), obj in sorted(self._objects.items()):
            if (group, plural) != (resource.group, resource.plural) or (ns and obj_ns != ns):
                continue
            labels = obj.get("metadata", {}).get("labels") or {}
            field_values = _field_values(resource, obj, name, obj_ns, fields)
            if _selects(selector, labels) and _selects(fields, field_values):
                # Like the real server, list items carry no kind/apiVersion.
                items.append(copy.deepcopy(obj))
        return {"kind": f"{resource.kind}List", "apiVersion": resource.api_version,
                "metadata": {"resourceVersion": str(self._revision)}, "items": items}

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
        self._revision += 1
        return str(self._revision)

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
        _normalise(resource, obj)
        _validate(resource, obj, None)
        meta.pop("resourceVersion", None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now())
        leaves = _user_leaves(obj)
        meta["managedFields"] = [_managed_entry(manager, operation, leaves, resource)]
        meta["resourceVersion"] = self._next_revision()
        self._objects[key] = obj
        self._record_change("ADDED", resource, obj)
        return obj

    def _update(self, resource: Resource, key: tuple, obj: dict, manager: str) -> dict:
        live = self._existing(resource, key)
        rv = obj["metadata"].get("resourceVersion")
        if rv and rv != live["metadata"]["resourceVersion"]:
            raise _conflict_modified(resource, key[3])
        _normalise(resource, obj)
        for system in ("uid", "creationTimestamp", "managedFields"):
            if system in live["metadata"]:
                obj["metadata"][system] = live["metadata"][system]
        changed = {p for p, v in _user_leaves(obj).items()
                   if _user_leaves(live).get(p) != v}
        _take_ownership(obj, manager, "Update", changed, resource)
        return self._commit(resource, key, live, obj)

    def _commit(self, resource: Resource, key: tuple, live: dict | None, obj: dict) -> dict:
        _validate(resource, obj, live)
        if live is not None and _comparable(live) == _comparable(obj):
            return live  # a no-op write: the real server keeps the resourceVersion
        obj["metadata"]["resourceVersion"] = self._next_revision()
        self._objects[key] = obj
        self._record_change("MODIFIED", resource, obj)
        return obj

    def _patch(self, resource, key, query, content_type, body, manager):
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
                return 201, self._public(resource, self._create(resource, key[2], obj, manager,
                                                                "Apply"))
            return 200, self._public(resource, self._apply(resource, key, live, obj,
                                                           manager, force))
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
            raise _conflict_modified(resource, key[3])
        obj = _merge_patch(copy.deepcopy(live), body)
        changed = {p for p, v in _user_leaves(obj).items()
                   if _user_leaves(live).get(p) != v}
        _take_ownership(obj, manager or "unknown", "Update", changed, resource)
        _normalise(resource, obj)
        return 200, self._public(resource, self._commit(resource, key, live, obj))

    def _apply(self, resource, key, live, applied, manager, force) -> dict:
        new_leaves = _user_leaves(applied)
        entries = live["metadata"].get("managedFields") or []
        conflicts = []
        live_leaves = _user_leaves(live)
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
                           {"name": key[3], "group": resource.group, "kind": resource.plural})
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
        _normalise(resource, obj)
        _take_ownership(obj, manager, "Apply", set(new_leaves), resource, replace=True)
        return self._commit(resource, key, live, obj)

    def _delete(self, resource: Resource, key: tuple, body: Any) -> dict:
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


class _Handler(BaseHTTPRequestHandler):
    api: FakeApiServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # quiet: the request log is in FakeApiServer.requests

    def _serve(self) -> None:
        split = urlsplit(self.path)
        query = parse_qs(split.query)
        if self.command == "GET" and _is_watch(query):
            self._watch(split.path, query)
            return
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        body: Any = None
        status, payload = 500, {}
        try:
            if raw:
                try:
                    body = yaml.safe_load(raw) if content_type == APPLY else json.loads(raw)
                except (ValueError, yaml.YAMLError) as e:
                    raise ApiError(400, "BadRequest", f"the request body is malformed: {e}") from e
            if self.api.token and self.headers.get("Authorization") != f"Bearer {self.api.token}":
                raise ApiError(401, "Unauthorized", "Unauthorized")
            with self.api._lock:
                if self.api.on_request:
                    self.api.on_request(self.command, split.path)
                status, payload = self.api.handle(self.command, split.path, query,
                                                  content_type, body)
        except ApiError as e:
            status, payload = e.code, e.status()
        except Exception as e:  # a stand-in bug must surface as a 500, not a dropped socket
            status, payload = 500, ApiError(500, "InternalError", repr(e)).status()
        with self.api._lock:
            self.api.requests.append(RecordedRequest(self.command, split.path, query,
                                                     content_type, body, status))
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

    def _watch(self, path: str, query: dict) -> None:
        """Stream the changes of a collection as the API server's watch does (module doc)."""
        api = self.api
        try:
            if api.token and self.headers.get("Authorization") != f"Bearer {api.token}":
                raise ApiError(401, "Unauthorized", "Unauthorized")
            with api._lock:
                if api.on_request:
                    api.on_request("GET", path)
                resource, ns, name = api._route(path)
            if name:
                raise ApiError(405, "MethodNotAllowed", "watch a collection, with a field selector for one object")
            if api.refuse_watch:
                raise ApiError(api.refuse_watch, "Forbidden",
                               f'{resource.plural} is forbidden: User "system:serviceaccount:test:agent" '
                               f'cannot watch resource "{resource.plural}" in API group "{resource.group}" '
                               "at the cluster scope")
            labels = _parse_selector((query.get("labelSelector") or [""])[0])
            fields = _parse_selector((query.get("fieldSelector") or [""])[0])
        except ApiError as e:
            with api._lock:
                api.requests.append(RecordedRequest("GET", path, query, "", None, e.code))
            data = json.dumps(e.status()).encode()
            self.send_response(e.code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        with api._lock:
            api.requests.append(RecordedRequest("GET", path, query, "", None, 200))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def picks(obj: dict, obj_ns: str) -> bool:
            meta = obj.get("metadata") or {}
            return ((not ns or obj_ns == ns)
                    and _selects(labels, meta.get("labels") or {})
                    and _selects(fields, _field_values(resource, obj, meta.get("name", ""), obj_ns, fields)))

        timeout = float((query.get("timeoutSeconds") or ["1800"])[0])
        deadline = time.monotonic() + timeout
        since = (query.get("resourceVersion") or [""])[0]
        events: list[dict] = []
        with api._lock:
            if since in ("", "0"):
                last = api._revision
                events = [{"type": "ADDED", "object": api._public(resource, obj)}
                          for (group, plural, obj_ns, _), obj in sorted(api._objects.items())
                          if (group, plural) == (resource.group, resource.plural) and picks(obj, obj_ns)]
            elif int(since) < api._compacted:
                events = [{"type": "ERROR", "object": ApiError(
                    410, "Expired", f"too old resource version: {since} ({api._compacted})").status()}]
                last = None
            else:
                last = int(since)
        try:
            while True:
                for event in events:
                    self._chunk(json.dumps(event).encode() + b"\n")
                if last is None:
                    break
                with api._changed:
                    while True:
                        fresh = [(rev, kind, obj) for rev, kind, r, obj in api._history
                                 if rev > last and r == resource
                                 and picks(obj, (obj.get("metadata") or {}).get("namespace", ""))]
                        left = deadline - time.monotonic()
                        if fresh or left <= 0 or api._stopping:
                            break
                        api._changed.wait(min(left, 0.5))
                if not fresh:
                    break
                last = fresh[-1][0]
                events = [{"type": kind, "object": api._public(resource, obj)} for _, kind, obj in fresh]
            self._chunk(b"")
        except OSError:
            pass  # the client went away

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def _field_values(resource: Resource, obj: dict, name: str, ns: str, fields) -> dict[str, str]:
    values = {"metadata.name": name, "metadata.namespace": ns}
    extra = SELECTABLE_FIELDS.get(resource.kind)
    if extra is not None:
        values.update(extra(obj))
    for _, key, _ in fields:
        if key not in values:
            raise ApiError(400, "BadRequest", f'field label not supported: {key}')
    return values


def _is_watch(query: dict) -> bool:
    return (query.get("watch") or [""])[0] in ("true", "1")


# --- object rules --------------------------------------------------------

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_SYSTEM_META = ("name", "namespace", "uid", "resourceVersion", "creationTimestamp",
                "managedFields", "generation", "generateName")


def _normalise(resource: Resource, obj: dict) -> None:
    if resource.kind == "Secret":
        # stringData is write-only: the server folds it into base64 data.
        for k, v in (obj.pop("stringData", None) or {}).items():
            obj.setdefault("data", {})[k] = base64.b64encode(str(v).encode()).decode()
        obj.setdefault("type", "Opaque")


def _validate(resource: Resource, obj: dict, old: dict | None) -> None:
    name = obj["metadata"]["name"]
    problems = []
    if resource.kind == "RuntimeClass":
        handler = obj.get("handler")
        if not handler:
            problems.append("handler: Required value")
        elif not (len(handler) <= 63 and _DNS_LABEL.fullmatch(handler)):
            problems.append(f"handler: Invalid value: \"{handler}\": a lowercase RFC 1123 label")
        if old is not None and handler != old.get("handler"):
            problems.append(f"handler: Invalid value: \"{handler}\": field is immutable")
    if resource.kind == "Event":
        # kube-apiserver (pkg/apis/core/validation/events.go, legacyValidateEvent): an Event
        # about a cluster-scoped object (no involvedObject.namespace) lives in "default"
        # (or kube-system for one with eventTime); found by the control-plane suite.
        involved = (obj.get("involvedObject") or {}).get("namespace") or ""
        namespace = obj["metadata"].get("namespace") or ""
        allowed = {"", "default"} | ({"kube-system"} if obj.get("eventTime") else set())
        if not involved and namespace not in allowed:
            problems.append('involvedObject.namespace: Invalid value: "": '
                            "does not match event.namespace")
        elif involved and involved != namespace:
            problems.append(f'involvedObject.namespace: Invalid value: "{involved}": '
                            "does not match event.namespace")
    if resource.kind == "ResourceSlice":
        problems += resourceapi.slice_problems(obj, old)
    if resource.kind == "Secret" and obj.get("type") == "kubernetes.io/dockerconfigjson":
        if ".dockerconfigjson" not in (obj.get("data") or {}):
            problems.append("data[.dockerconfigjson]: Required value")
    if problems:
        group = f".{resource.group}" if resource.group else ""
        raise ApiError(422, "Invalid",
                       f"{resource.kind}{group} \"{name}\" is invalid: " + ", ".join(problems),
                       {"name": name, "group": resource.group, "kind": resource.kind})


def _not_found(resource: Resource, name: str) -> ApiError:
    return ApiError(404, "NotFound", f"{resource.qualified} \"{name}\" not found",
                    {"name": name, "group": resource.group, "kind": resource.plural})


def _conflict_modified(resource: Resource, name: str) -> ApiError:
    return ApiError(409, "Conflict",
                    f"Operation cannot be fulfilled on {resource.qualified} \"{name}\": the "
                    "object has been modified; please apply your changes to the latest version "
                    "and try again",
                    {"name": name, "group": resource.group, "kind": resource.plural})


def _comparable(obj: dict) -> dict:
    out = copy.deepcopy(obj)
    out["metadata"].pop("resourceVersion", None)
    for entry in out["metadata"].get("managedFields") or []:
        entry.pop("time", None)
    return out


# --- field paths and managedFields (FieldsV1) ----------------------------

Path_ = tuple[str, ...]


def _user_leaves(obj: dict) -> dict[Path_, Any]:
    """Leaf paths of the fields a user sets (system metadata excluded; lists atomic)."""
    out: dict[Path_, Any] = {}

    def walk(value: Any, prefix: Path_) -> None:
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


def _encode_fields(paths: set[Path_]) -> dict:
    root: dict = {}
    for path in sorted(paths):
        node = root
        for depth, key in enumerate(path):
            node = node.setdefault(f"f:{key}", {})
            if depth < len(path) - 1:
                node.setdefault(".", {})
    return root


def _decode_fields(fields: dict, prefix: Path_ = ()) -> set[Path_]:
    out: set[Path_] = set()
    children = {k: v for k, v in fields.items() if k.startswith("f:")}
    if not children and prefix:
        out.add(prefix)
    for k, v in children.items():
        out |= _decode_fields(v or {}, (*prefix, k[2:]))
    return out


def _managed_entry(manager: str, operation: str, paths, resource: Resource) -> dict:
    return {"manager": manager, "operation": operation, "apiVersion": resource.api_version,
            "time": _now(), "fieldsType": "FieldsV1", "fieldsV1": _encode_fields(set(paths))}


def _take_ownership(obj: dict, manager: str, operation: str, paths: set[Path_],
                    resource: Resource, replace: bool = False) -> None:
    """Give ``paths`` to manager/operation, taking them from everyone else."""
    entries = []
    mine: set[Path_] = set()
    present = set(_user_leaves(obj))
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
        entries.append(_managed_entry(manager, operation, mine, resource))
    obj["metadata"]["managedFields"] = entries


def _set_path(obj: dict, path: Path_, value: Any) -> None:
    for key in path[:-1]:
        if not isinstance(obj.get(key), dict):
            obj[key] = {}
        obj = obj[key]
    obj[path[-1]] = value


def _remove_path(obj: dict, path: Path_) -> None:
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


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (also our strategic merge: maps merged, lists replaced)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if not isinstance(target, dict):
        target = {}
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        else:
            target[k] = _merge_patch(target.get(k), v)
    return target


# --- selectors -------------------------------------------------------------

_REQUIREMENT = re.compile(
    r"\s*(?P<neg>!)?\s*(?P<key>[A-Za-z0-9_./-]+)\s*"
    r"(?:(?P<op>==|=|!=|\s+in\s+|\s+notin\s+)\s*(?P<value>\([^)]*\)|[A-Za-z0-9_.-]*))?\s*"
)


def _parse_selector(text: str) -> list[tuple[str, str, set[str]]]:
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


def _selects(requirements, labels: dict) -> bool:
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
