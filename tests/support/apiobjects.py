"""The kinds the API server stand-in (``support.apiserver``) serves and the rules it holds
their objects to, apart from how they are stored or served.

- where each kind lives on the URL (``/api/v1/...``, ``/apis/<group>/<version>/...``,
  namespaced or cluster scoped), and how an object reads back (``kind``/``apiVersion`` added);
- errors as the server's ``Status`` objects, with its reason, code and messages;
- what the server defaults (a Secret's ``stringData`` folded into ``data``) and refuses
  (422 Invalid: a RuntimeClass's ``handler``, an Event's namespace, a ResourceSlice by the
  rules of ``support.resourceapi``). A rule the real server showed the control-plane suite
  that the stand-in lacked goes in ``validate``, citing where the API server has it.
"""

from __future__ import annotations

import base64
import copy
import re
from dataclasses import dataclass
from datetime import UTC, datetime

from support import resourceapi


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
        Resource("resource.k8s.io", "v1", "resourceclaimtemplates", "ResourceClaimTemplate", True),
        Resource("resource.k8s.io", "v1", "deviceclasses", "DeviceClass", False),
    )
}


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


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def route(path: str) -> tuple[Resource, str, str]:
    """The resource, namespace and name (empty for a collection) a URL path names."""
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
    # A namespaced resource's collection without a namespace is every namespace's (a list or a
    # watch: ``list_pod_for_all_namespaces``); one object is always named in its namespace.
    if resource is None or len(rest) > 2 or (bool(ns) and not resource.namespaced) or (
            resource.namespaced and not ns and len(rest) == 2):
        raise ApiError(404, "NotFound", "the server could not find the requested resource")
    return resource, ns, rest[1] if len(rest) == 2 else ""


def resource_for(obj: dict) -> Resource:
    """The resource of an object by its apiVersion and kind."""
    group, _, version = obj["apiVersion"].rpartition("/")
    for r in RESOURCES.values():
        if r.group == group and r.version == version and r.kind == obj["kind"]:
            return r
    raise KeyError(f"stand-in does not serve {obj['apiVersion']} {obj['kind']}")


def public(resource: Resource, obj: dict) -> dict:
    """A stored object as a GET or a watch event answers it (a list's items stay bare)."""
    return {"kind": resource.kind, "apiVersion": resource.api_version, **copy.deepcopy(obj)}


def not_found(resource: Resource, name: str) -> ApiError:
    return ApiError(404, "NotFound", f"{resource.qualified} \"{name}\" not found",
                    {"name": name, "group": resource.group, "kind": resource.plural})


def conflict_modified(resource: Resource, name: str) -> ApiError:
    return ApiError(409, "Conflict",
                    f"Operation cannot be fulfilled on {resource.qualified} \"{name}\": the "
                    "object has been modified; please apply your changes to the latest version "
                    "and try again",
                    {"name": name, "group": resource.group, "kind": resource.plural})


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def normalise(resource: Resource, obj: dict) -> None:
    if resource.kind == "Secret":
        # stringData is write-only: the server folds it into base64 data.
        for k, v in (obj.pop("stringData", None) or {}).items():
            obj.setdefault("data", {})[k] = base64.b64encode(str(v).encode()).decode()
        obj.setdefault("type", "Opaque")


def validate(resource: Resource, obj: dict, old: dict | None) -> None:
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
