"""A small, faithful stand-in for the Kubernetes API server.

No kube-apiserver runs on our machines, so the official client talks HTTP to
this one instead. It follows the real server where our code can notice, each part in
its own module:

- ``support.apiobjects``: the URL layout (``/api/v1/...``, ``/apis/<group>/<version>/...``,
  namespaced or cluster scoped) of RuntimeClasses (node.k8s.io/v1), Secrets, Nodes, Events
  and Pods (core v1, stored as given), and ResourceSlices, ResourceClaims, ResourceClaimTemplates and DeviceClasses
  (resource.k8s.io/v1, with the ResourceSlice rules of ``support.resourceapi``); errors as
  ``Status`` objects with reason and code (404 NotFound, 409 AlreadyExists / Conflict,
  422 Invalid, 400 BadRequest, 401, 415); RuntimeClass ``handler`` validation and
  immutability, and the other rules the real server holds objects to;
- ``support.apistore``: a global resourceVersion bumped on every real write (a no-op write
  keeps it), uid and creationTimestamp set by the server; merge patch and strategic merge
  patch (maps merged, lists replaced, null deletes), optimistic concurrency on PUT/PATCH
  and delete preconditions;
- ``support.managedfields``: server-side apply (``application/apply-patch+yaml``):
  fieldManager required, create if absent, field ownership in ``metadata.managedFields``
  (FieldsV1), conflicts with other managers unless ``force=true``, removal of fields the
  applier owned and stopped sending; lists are atomic;
- ``support.apiselectors``: label and field selectors;
- ``support.apiwatch``: watch (``?watch=true`` on a collection), resumed from a
  resourceVersion, 410 ``Expired`` once ``compact()`` dropped it;
- ``support.apihttp``: the HTTP the client speaks, and the request log.

This module is the server a test starts: its lifecycle (a restart keeps the objects),
its client and kubeconfig, the knobs a test turns (``on_request``, ``refuse_watch``,
``start(warming=N)``) and the helpers that change the world as another client would.
Every request is recorded (``requests`` / ``writes()``) so tests can assert what
was written, and how often.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml
from kubernetes.client import ApiClient, Configuration

from support.apihttp import Handler, RecordedRequest
from support.apiobjects import ApiError, route
from support.apistore import ObjectStore
from support.apiwatch import is_watch


class FakeApiServer:
    """In-memory API server on 127.0.0.1; use as a context manager."""

    def __init__(self, token: str | None = None):
        self.token = token
        self.requests: list[RecordedRequest] = []
        self.store = ObjectStore()
        # Called as on_request(method, path) under the store's lock, before the request is
        # served: lets a test change the world at an exact moment (races).
        self.on_request: Callable[[str, str], None] | None = None
        self._httpd: ThreadingHTTPServer | None = None
        self._port = 0  # chosen at the first start, kept for a restart
        self._thread: threading.Thread | None = None
        self.stopping = False  # ends the watch streams
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

        class ServerHandler(Handler):
            api = server

        with self.store.lock:
            self.stopping = False
        self._httpd = ThreadingHTTPServer(("127.0.0.1", self._port), ServerHandler)
        self._port = self._httpd.server_address[1]
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,),
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self.store.changed:
            self.stopping = True
            self.store.changed.notify_all()
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
        return self.store.seed(obj)

    def get(self, plural: str, name: str, namespace: str = "") -> dict | None:
        return self.store.get(plural, name, namespace)

    def update(self, plural: str, name: str, change: Callable[[dict], None],
               namespace: str = "") -> dict:
        """Change a stored object as another client would (new resourceVersion)."""
        return self.store.update(plural, name, change, namespace)

    def remove(self, plural: str, name: str, namespace: str = "") -> None:
        self.store.remove(plural, name, namespace)

    def names(self, plural: str) -> list[str]:
        return self.store.names(plural)

    def compact(self) -> None:
        """Forget the change history, as etcd compaction does: a watch that resumes from
        an earlier resourceVersion is answered 410 Expired."""
        self.store.compact()

    def watches(self, plural: str) -> list[RecordedRequest]:
        """The watch requests made on a collection."""
        return [r for r in self.requests if r.method == "GET" and r.path.endswith("/" + plural)
                and is_watch(r.query)]

    def writes(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.method not in ("GET", "HEAD")]

    def clear_log(self) -> None:
        self.requests.clear()

    # --- a request (the store's lock held) -------------------------------

    def handle(self, method: str, path: str, query: dict, content_type: str,
               body: Any) -> tuple[int, dict]:
        # The Node's status subresource (PATCH only: what node agents write it with).
        status = method == "PATCH" and path.startswith("/api/v1/nodes/") and path.endswith("/status")
        resource, ns, name = route(path.removesuffix("/status") if status else path)
        if resource.namespaced and not ns and method != "GET":  # every namespace's: read only
            raise ApiError(405, "MethodNotAllowed", f"the server does not allow this method on {resource.plural}")
        if method != "GET" and self._warming > 0:
            self._warming -= 1
            raise ApiError(403, "Forbidden", f"{resource.plural} is forbidden: not yet ready to handle request")
        return self.store.handle(method, resource, ns, name, query, content_type, body,
                                 subresource="status" if status else "")
