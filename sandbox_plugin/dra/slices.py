"""This node's ResourceSlice: one pool named after the node, published, kept and removed.

The driver's devices on a node are one pool (``spec.pool.name``: the node's name)
in one ResourceSlice with ``spec.nodeName`` and ``spec.driver`` set, as
k8s.io/dynamic-resource-allocation's ``kubeletplugin`` publishes a node-local
driver's devices: named by the API server from ``<node>-<driver>-`` and owned by
the Node (``ownerReferences``), so the garbage collector removes it with the Node.
Each change of the devices bumps ``spec.pool.generation`` (a scheduler only trusts
the slices of a pool's newest generation) and is written with the
``resourceVersion`` read, so a concurrent writer is noticed rather than
overwritten. A pool with no device to offer is no slice at all: the slice is
deleted (after a revert, on a relabel away from vm-passthrough).

``sync`` makes the API match what it is given and returns what it did; the driver
calls it after every device change, writing over the slice it wrote last (one call;
a 404 or 409 means someone else changed it: it then lists and tries again), and on a
timer with ``verify``, which lists first and so also puts back a slice someone else
removed (the kubelet deletes its node's slices when it starts and
when a driver's registration socket goes away: pkg/kubelet/cm/dra/plugin
``wipeResourceSlices``). It lists with the field selectors the API server offers
for ResourceSlices, ``spec.nodeName`` and ``spec.driver``
(k8s.io/api resource/v1 ``ResourceSliceSelectorNodeName``, ``...Driver``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence

from kubernetes.client import ApiClient, CoreV1Api, ResourceV1Api
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from gpunode.errors import GpuNodeError
from gpunode.services.kube import api_error_message
from sandbox_plugin.dra.devices import DraDevice

log = logging.getLogger(__name__)

TIMEOUT = 10.0  # seconds for one API call
CONFLICT = 409
NOT_FOUND = 404


class SliceError(GpuNodeError):
    """The API server refused or did not answer a ResourceSlice call."""


def _fail(what: str, error: Exception) -> SliceError:
    if isinstance(error, ApiException):
        hint = ("; grant the driver's service account list, create, update and delete on "
                "resourceslices" if error.status in (401, 403) else "")
        return SliceError(f"cannot {what}: {api_error_message(error)}{hint}")
    return SliceError(f"cannot {what}: API server unreachable ({error})")


class SlicePublisher:
    """Keeps the ResourceSlice of ``driver`` on ``node`` equal to the devices given."""

    def __init__(self, api: ApiClient, driver: str, node: str, *, timeout: float = TIMEOUT) -> None:
        self.api = api
        self.driver = driver
        self.node = node
        self.timeout = timeout
        self.generation = 0  # the pool generation last written (0: none yet)
        self._owner: list[dict] | None = None
        self._known: dict | None = None  # the slice as we last wrote it (the server's answer)
        self._lock = threading.Lock()  # one sync at a time

    @property
    def _resources(self) -> ResourceV1Api:
        return ResourceV1Api(self.api)

    def sync(self, devices: Sequence[DraDevice], *, verify: bool = False) -> str:
        """Make the node's slice offer ``devices`` (the healthy ones); none: no slice.
        ``verify``: list the node's slices first rather than trust the one last written.
        Returns what was done: created, updated, deleted, unchanged or none."""
        offered = [d.to_api() for d in devices if d.healthy]
        with self._lock:
            try:
                return self._sync(offered, verify or self._known is None)
            except ApiException as e:
                if e.status not in (CONFLICT, NOT_FOUND):
                    self._known = None
                    raise _fail(f"write the ResourceSlice of node {self.node}", e) from e
                log.info("the ResourceSlice of node %s changed under us; reading it again", self.node)
                try:
                    return self._sync(offered, True)
                except (ApiException, HTTPError) as again:
                    self._known = None
                    raise _fail(f"write the ResourceSlice of node {self.node}", again) from again
            except HTTPError as e:
                self._known = None
                raise _fail(f"write the ResourceSlice of node {self.node}", e) from e

    def _sync(self, offered: list[dict], verify: bool) -> str:
        existing = self._ours() if verify else [self._known] if self._known else []
        self._known = None  # set again below once the API holds what we wrote
        if not offered:
            for item in existing:
                self._delete(item)
            return "deleted" if existing else "none"
        keep, extra = (existing[0], existing[1:]) if existing else (None, [])
        for item in extra:  # a second writer's, or an older run's: one pool, one slice
            self._delete(item)
        if keep is None:
            self.generation += 1
            body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                    "metadata": {"generateName": f"{self.node}-{self.driver}-"},
                    "spec": self._spec(offered)}
            owner = self._node_owner()
            if owner:
                body["metadata"]["ownerReferences"] = owner
            created = self._call(self._resources.create_resource_slice, body)
            self._known = created
            log.info("published ResourceSlice %s: %d device(s), pool %s generation %d",
                     created["metadata"]["name"], len(offered), self.node, self.generation)
            return "created"
        spec = keep.get("spec") or {}
        live = int((spec.get("pool") or {}).get("generation") or 0)
        self.generation = max(self.generation, live)
        if _devices(spec) == _devices({"devices": offered}) and spec.get("nodeName") == self.node:
            self._known = keep
            return "unchanged"
        self.generation += 1
        body = {**keep, "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                "spec": self._spec(offered)}
        self._known = self._call(self._resources.replace_resource_slice, keep["metadata"]["name"], body)
        log.info("updated ResourceSlice %s: %d device(s), pool %s generation %d",
                 keep["metadata"]["name"], len(offered), self.node, self.generation)
        return "updated"

    def _spec(self, offered: list[dict]) -> dict:
        return {"driver": self.driver, "nodeName": self.node,
                "pool": {"name": self.node, "generation": self.generation, "resourceSliceCount": 1},
                "devices": offered}

    def _ours(self) -> list[dict]:
        listed = self._call(self._resources.list_resource_slice,
                            field_selector=f"spec.nodeName={self.node},spec.driver={self.driver}")
        items = [i for i in listed.get("items") or []
                 if (i.get("spec") or {}).get("driver") == self.driver
                 and (i.get("spec") or {}).get("nodeName") == self.node]
        return sorted(items, key=lambda i: i["metadata"]["name"])

    def _delete(self, item: dict) -> None:
        name = item["metadata"]["name"]
        try:
            # Unparsed: the answer (the object or a Status) is not needed.
            self._resources.delete_resource_slice(name, _preload_content=False,
                                                  _request_timeout=self.timeout)
        except ApiException as e:
            if e.status != 404:
                raise
        log.info("deleted ResourceSlice %s of node %s", name, self.node)

    def _node_owner(self) -> list[dict]:
        """The Node as the slice's owner, so the slice goes with it; none when the Node
        cannot be read (the slice is then removed by this driver or the kubelet only)."""
        if self._owner is None:
            try:
                node = CoreV1Api(self.api).read_node(self.node, _request_timeout=self.timeout)
                uid = node.metadata.uid
            except (ApiException, HTTPError) as e:
                log.info("node %s cannot be read (%s); its ResourceSlice gets no owner", self.node,
                         api_error_message(e) if isinstance(e, ApiException) else e)
                uid = None
            self._owner = ([{"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": uid,
                             "controller": True}] if uid else [])
        return self._owner

    def _call(self, method, *args, **kwargs) -> dict:
        response = method(*args, _preload_content=False, _request_timeout=self.timeout, **kwargs)
        return json.loads(response.data)


def _devices(spec: dict) -> list:
    """What a slice offers, as we compare it: each device's name and attributes."""
    return [(d.get("name"), d.get("attributes") or {}) for d in spec.get("devices") or []]
