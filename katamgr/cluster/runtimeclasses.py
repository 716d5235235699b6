"""RuntimeClass objects for the configured Kata runtime classes, by server-side apply.

We read every RuntimeClass once, compare the fields we want (and the fields our
field manager still owns) with what is live, and apply only those that differ:
an unchanged cluster gets no write at all. Classes we created that left the
config are deleted; classes labeled by anyone else are never touched.

Every class we create carries ``app.kubernetes.io/managed-by=kata-sandbox-manager``, so a
revert finds what katamgr created by that label (a server-side label selector), not by
the config it is given: a class an earlier config named is deleted too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes.client import ApiClient, NodeV1Api, V1DeleteOptions, V1Preconditions
from kubernetes.client.exceptions import ApiException
from kubernetes.utils.quantity import parse_quantity
from urllib3.exceptions import HTTPError

from gpunode.errors import GpuNodeError
from gpunode.services.kube import api_error_message
from katamgr.cluster.client import FIELD_MANAGER, MANAGED_BY_LABEL, MANAGED_BY_VALUE
from katamgr.config import KataManagerConfig

log = logging.getLogger(__name__)

API_VERSION = "node.k8s.io/v1"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"


@dataclass(frozen=True)
class RuntimeClassChanges:
    """What one reconcile did to the cluster's RuntimeClasses (names, sorted)."""

    created: tuple[str, ...] = ()
    updated: tuple[str, ...] = ()
    unchanged: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()
    # Ours by label, but this service account may not delete them (another release's,
    # or made with another config by hand): left, and said so.
    refused: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.created or self.updated or self.deleted)


def desired_runtime_classes(config: KataManagerConfig) -> list[dict[str, Any]]:
    """The apply body of each configured RuntimeClass (handler = name)."""
    bodies = []
    for rc in config.runtime_classes:
        body: dict[str, Any] = {
            "apiVersion": API_VERSION,
            "kind": "RuntimeClass",
            "metadata": {"name": rc.name, "labels": {MANAGED_BY_LABEL: MANAGED_BY_VALUE}},
            "handler": rc.handler,
            "scheduling": {"nodeSelector": rc.scheduling_node_selector},
        }
        if config.overhead_pod_fixed:
            body["overhead"] = {"podFixed": dict(config.overhead_pod_fixed)}
        bodies.append(body)
    return bodies


def reconcile_runtime_classes(api: ApiClient, config: KataManagerConfig) -> RuntimeClassChanges:
    """Make the cluster's RuntimeClasses match ``config``; return what changed."""
    node_api = NodeV1Api(api)
    live = {obj["metadata"]["name"]: obj for obj in _list(api, node_api)}
    created, updated, unchanged, deleted = [], [], [], []
    immutable: list[str] = []

    for body in desired_runtime_classes(config):
        name = body["metadata"]["name"]
        current = live.get(name)
        if current is not None and current.get("handler") != body["handler"]:
            # The API server refuses to change a handler; only a delete can fix it,
            # and the object may be someone else's, so the operator decides.
            immutable.append(
                f"RuntimeClass {name} exists with handler {current.get('handler')!r}, not {name!r}"
            )
            continue
        if current is not None and _up_to_date(current, body):
            unchanged.append(name)
            continue
        if current is not None and not _is_ours(current):
            log.warning("adopting RuntimeClass %s, which was not labeled %s=%s",
                        name, MANAGED_BY_LABEL, MANAGED_BY_VALUE)
        try:
            node_api.patch_runtime_class(
                name,
                body,
                field_manager=FIELD_MANAGER,
                force=True,
                _content_type=APPLY_CONTENT_TYPE,
            )
        except (ApiException, HTTPError) as e:
            raise _failure(f"apply RuntimeClass {name}", e) from e
        if current is None:
            log.info("created RuntimeClass %s (handler %s, nodeSelector %s)",
                     name, name, body["scheduling"]["nodeSelector"])
            created.append(name)
        else:
            log.info("updated RuntimeClass %s to nodeSelector %s%s", name,
                     body["scheduling"]["nodeSelector"],
                     f", overhead {body['overhead']['podFixed']}" if "overhead" in body else "")
            updated.append(name)

    wanted = {rc.name for rc in config.runtime_classes}
    for name, obj in sorted(live.items()):
        if name in wanted or not _is_ours(obj):
            continue
        try:
            if _delete(node_api, name, obj["metadata"].get("resourceVersion")):
                deleted.append(name)
        except _Forbidden as e:
            raise _failure(f"delete RuntimeClass {name}", e.__cause__) from e

    if immutable:
        raise GpuNodeError(
            "; ".join(immutable)
            + ": a RuntimeClass handler cannot change, so delete it "
            "(kubectl delete runtimeclass NAME) and katamgr will recreate it"
        )
    return RuntimeClassChanges(
        created=tuple(sorted(created)),
        updated=tuple(sorted(updated)),
        unchanged=tuple(sorted(unchanged)),
        deleted=tuple(sorted(deleted)),
    )


def delete_managed_runtime_classes(api: ApiClient, config: KataManagerConfig | None = None) -> RuntimeClassChanges:
    """Remove every RuntimeClass katamgr created, found by its label whatever the config
    names now (the cluster half of a revert). A class this service account may not delete
    (RBAC names the classes it may: a chart release's own) is left and listed as refused."""
    node_api = NodeV1Api(api)
    deleted, refused = [], []
    for obj in _list(api, node_api, label_selector=f"{MANAGED_BY_LABEL}={MANAGED_BY_VALUE}"):
        name = obj["metadata"]["name"]
        if not _is_ours(obj):  # the server picked it by the label; checked all the same
            continue
        try:
            if _delete(node_api, name, obj["metadata"].get("resourceVersion")):
                deleted.append(name)
        except _Forbidden:
            log.warning("RuntimeClass %s is labeled %s=%s but this service account may not delete it "
                        "(another release's, or created by hand); left it", name, MANAGED_BY_LABEL,
                        MANAGED_BY_VALUE)
            refused.append(name)
    return RuntimeClassChanges(deleted=tuple(sorted(deleted)), refused=tuple(sorted(refused)))


class _Forbidden(Exception):
    """A delete the API server refused with 403."""


def _list(api: ApiClient, node_api: NodeV1Api, label_selector: str | None = None) -> list[dict[str, Any]]:
    try:
        listing = (node_api.list_runtime_class(label_selector=label_selector) if label_selector
                   else node_api.list_runtime_class())
    except (ApiException, HTTPError) as e:
        raise _failure("list RuntimeClasses", e) from e
    return [api.sanitize_for_serialization(item) for item in listing.items or []]


def _delete(node_api: NodeV1Api, name: str, resource_version: str | None) -> bool:
    # The precondition makes sure we delete the object we looked at: if someone
    # relabeled it since, the server answers 409 and it stays.
    options = V1DeleteOptions(preconditions=V1Preconditions(resource_version=resource_version))
    try:
        node_api.delete_runtime_class(name, body=options)
    except ApiException as e:
        if e.status == 404:
            log.info("RuntimeClass %s was already deleted", name)
            return False
        if e.status == 409:
            log.warning("RuntimeClass %s changed while reconciling; left it for the next pass (%s)",
                        name, api_error_message(e))
            return False
        if e.status == 403:
            raise _Forbidden(name) from e
        raise _failure(f"delete RuntimeClass {name}", e) from e
    except HTTPError as e:
        raise _failure(f"delete RuntimeClass {name}", e) from e
    log.info("deleted RuntimeClass %s: it is no longer in the config", name)
    return True


def _is_ours(obj: Mapping[str, Any]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return labels.get(MANAGED_BY_LABEL) == MANAGED_BY_VALUE


def _up_to_date(live: Mapping[str, Any], body: Mapping[str, Any]) -> bool:
    """Would applying ``body`` change nothing? (Values equal, no stale field of ours left.)"""
    wanted = dict(_leaves(body, ()))
    for path, value in wanted.items():
        if path in (("apiVersion",), ("kind",), ("metadata", "name")):
            continue
        have = _get(live, path)
        if not _same(path, have, value):
            return False
    # A field we applied before but no longer send (say, overhead dropped from
    # the config) is removed by the next apply: that apply is a real change.
    for path in _owned_leaves(live):
        if path not in wanted and _get(live, path) is not None:
            return False
    return True


def _same(path: tuple[str, ...], have: Any, want: Any) -> bool:
    if path[:2] == ("overhead", "podFixed") and have is not None:
        # The API server canonicalises quantities ("0.25" comes back as "250m").
        try:
            return parse_quantity(str(have)) == parse_quantity(str(want))
        except ValueError:
            return False
    return have == want


def _leaves(obj: Any, prefix: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
    if isinstance(obj, Mapping) and obj:
        for key, value in obj.items():
            yield from _leaves(value, (*prefix, key))
    else:
        yield prefix, obj


def _get(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _owned_leaves(live: Mapping[str, Any]) -> set[tuple[str, ...]]:
    """Leaf field paths our field manager owns by apply, from metadata.managedFields."""
    owned: set[tuple[str, ...]] = set()
    for entry in live.get("metadata", {}).get("managedFields") or []:
        if entry.get("manager") != FIELD_MANAGER or entry.get("operation") != "Apply":
            continue
        stack: list[tuple[tuple[str, ...], Any]] = [((), entry.get("fieldsV1") or {})]
        while stack:
            prefix, fields = stack.pop()
            children = {k: v for k, v in fields.items() if k.startswith("f:")}
            if not children and prefix:
                owned.add(prefix)
            for key, sub in children.items():
                stack.append(((*prefix, key[2:]), sub if isinstance(sub, Mapping) else {}))
    return owned


def _failure(action: str, error: Exception) -> GpuNodeError:
    if isinstance(error, ApiException):
        hint = ""
        if error.status in (401, 403):
            hint = "; grant the agent's service account access to runtimeclasses (node.k8s.io)"
        return GpuNodeError(f"cannot {action}: {api_error_message(error)}{hint}")
    return GpuNodeError(f"cannot {action}: API server unreachable ({error})")
