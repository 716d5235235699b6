"""Watch for the API server stand-in (``support.apiserver``), as ``kubectl get -w`` and
client-go's reflectors use it: ``?watch=true`` on a collection answers a stream of events
``{"type": ADDED|MODIFIED|DELETED, "object": ...}`` for the objects the label and field
selectors pick, starting after ``resourceVersion`` (absent or "0": the current objects as
ADDED first), ended by the server after ``timeoutSeconds``. A ``resourceVersion`` older
than the history kept (``compact()`` drops it, as etcd compaction does) answers one ERROR
event with a 410 ``Expired`` Status, as the watch cache does (k8s.io/apiserver
``pkg/storage/cacher``).

This module decides the events; ``support.apihttp`` writes them as the chunked stream.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from support.apiobjects import ApiError, Resource, public, route
from support.apiselectors import Requirement, field_values, parse_selector, selects

if TYPE_CHECKING:
    from support.apiserver import FakeApiServer


def is_watch(query: dict) -> bool:
    return (query.get("watch") or [""])[0] in ("true", "1")


@dataclass
class Watch:
    api: FakeApiServer
    resource: Resource
    ns: str
    labels: list[Requirement]
    fields: list[Requirement]
    since: str
    deadline: float

    def _picks(self, obj: dict, obj_ns: str) -> bool:
        meta = obj.get("metadata") or {}
        return ((not self.ns or obj_ns == self.ns)
                and selects(self.labels, meta.get("labels") or {})
                and selects(self.fields, field_values(self.resource, obj, meta.get("name", ""),
                                                      obj_ns, self.fields)))

    def events(self) -> Iterator[dict]:
        """The events to send, as they come, until the deadline or the server stops; the
        store's lock is never held while the caller writes one."""
        store, resource = self.api.store, self.resource
        events: list[dict] = []
        with store.lock:
            if self.since in ("", "0"):
                last: int | None = store.revision
                events = [{"type": "ADDED", "object": public(resource, obj)}
                          for obj_ns, obj in store.current(resource) if self._picks(obj, obj_ns)]
            elif int(self.since) < store.compacted:
                events = [{"type": "ERROR", "object": ApiError(
                    410, "Expired",
                    f"too old resource version: {self.since} ({store.compacted})").status()}]
                last = None
            else:
                last = int(self.since)
        while True:
            yield from events
            if last is None:
                return
            with store.changed:
                while True:
                    fresh = [(rev, kind, obj) for rev, kind, obj in store.changes_after(resource, last)
                             if self._picks(obj, (obj.get("metadata") or {}).get("namespace", ""))]
                    left = self.deadline - time.monotonic()
                    if fresh or left <= 0 or self.api.stopping:
                        break
                    store.changed.wait(min(left, 0.5))
            if not fresh:
                return
            last = fresh[-1][0]
            events = [{"type": kind, "object": public(resource, obj)} for _, kind, obj in fresh]


def open_watch(api: FakeApiServer, path: str, query: dict) -> Watch:
    """The watch a request asks for; an ApiError if the server refuses it."""
    with api.store.lock:
        if api.on_request:
            api.on_request("GET", path)
        resource, ns, name = route(path)
    if name:
        raise ApiError(405, "MethodNotAllowed", "watch a collection, with a field selector for one object")
    if api.refuse_watch:
        raise ApiError(api.refuse_watch, "Forbidden",
                       f'{resource.plural} is forbidden: User "system:serviceaccount:test:agent" '
                       f'cannot watch resource "{resource.plural}" in API group "{resource.group}" '
                       "at the cluster scope")
    labels = parse_selector((query.get("labelSelector") or [""])[0])
    fields = parse_selector((query.get("fieldSelector") or [""])[0])
    timeout = float((query.get("timeoutSeconds") or ["1800"])[0])
    return Watch(api, resource, ns, labels, fields,
                 since=(query.get("resourceVersion") or [""])[0],
                 deadline=time.monotonic() + timeout)
