"""The pod rules of ``katamgr webhook``: pure functions of a Pod (the dict the API server
sends) and a ``Policy``.

- **GPU resources**: the container GPU names of NVIDIA's device plugin (``nvidia.com/gpu``,
  ``nvidia.com/gpu.shared``, ``nvidia.com/mig-*``) and every passthrough resource.
- **Passthrough resources**: the resources matching the policy's patterns (default every
  ``nvidia.com/*`` extended resource) that are not container GPU names, e.g. what
  sandbox-device-plugin advertises (``nvidia.com/GA102GL_A10``, ``nvidia.com/pgpu``,
  ``nvidia.com/nvswitch``).
- **mutate**: a pod that requests no GPU resource gets ``NVIDIA_VISIBLE_DEVICES=void`` in
  every container and init container (replacing what the user set), so the NVIDIA
  container runtime hides every GPU from it even on a node whose toolkit honours the
  variable; with ``inject_runtime_class``, a pod requesting a passthrough resource and no
  runtime class gets the first Kata class.
- **validate**: a pod requesting a passthrough resource is denied unless its
  ``runtimeClassName`` is one of the Kata runtime classes; a pod of a confidential class
  (``-snp``, ``-tdx``, or one the chart marks confidential) is denied a passthrough resource
  named after a GPU model that can never run a CC mode (``kataclasses.not_cc_capable_model``),
  naming the model.

A request counts when its quantity is not zero (in ``requests`` or ``limits``); a quantity
that cannot be parsed counts too (the safe side).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fnmatch import fnmatchcase
from typing import Any

from katamgr.k8snames import NVIDIA_CONTAINER_RESOURCES
from katamgr.kataclasses import (
    PASSTHROUGH_RUNTIME_CLASSES,
    confidential_by_name,
    not_cc_capable_model,
)

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
VOID = "void"
CONTAINER_GPU_RESOURCES = NVIDIA_CONTAINER_RESOURCES
# The Kata GPU classes a passthrough pod may use when none are named: the agent's, and
# kata-deploy's (TDX and runtime-rs included; katamgr.kataclasses).
DEFAULT_RUNTIME_CLASSES = PASSTHROUGH_RUNTIME_CLASSES
DEFAULT_PASSTHROUGH = ("nvidia.com/*",)

CONTAINER_LISTS = ("initContainers", "containers")
_QUANTITY = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*$")


@dataclass(frozen=True)
class Policy:
    runtime_classes: tuple[str, ...] = DEFAULT_RUNTIME_CLASSES
    passthrough: tuple[str, ...] = DEFAULT_PASSTHROUGH  # fnmatch patterns
    inject_runtime_class: bool = False
    # Classes marked confidential besides those named *-snp and *-tdx.
    confidential_classes: tuple[str, ...] = ()

    def is_confidential(self, runtime_class: str | None) -> bool:
        return bool(runtime_class) and (runtime_class in self.confidential_classes
                                        or confidential_by_name(runtime_class))

    def is_container_gpu(self, resource: str) -> bool:
        return any(fnmatchcase(resource, p) for p in CONTAINER_GPU_RESOURCES)

    def is_passthrough(self, resource: str) -> bool:
        return (not self.is_container_gpu(resource)
                and any(fnmatchcase(resource, p) for p in self.passthrough))

    def is_gpu(self, resource: str) -> bool:
        return self.is_container_gpu(resource) or self.is_passthrough(resource)


@dataclass(frozen=True)
class Request:
    """One non-zero resource request of one container."""

    list_name: str  # containers or initContainers
    index: int
    container: str
    resource: str

    @property
    def where(self) -> str:
        kind = "init container" if self.list_name == "initContainers" else "container"
        return f'{kind} "{self.container}"'


def nonzero(quantity: Any) -> bool:
    if isinstance(quantity, bool):
        return True
    if isinstance(quantity, int | float):
        return quantity != 0
    match = _QUANTITY.match(str(quantity))
    if not match:
        return True
    try:
        return Decimal(match.group(1)) != 0
    except InvalidOperation:
        return True


def _containers(pod: dict[str, Any]) -> Iterator[tuple[str, int, dict[str, Any]]]:
    spec = pod.get("spec") or {}
    for list_name in CONTAINER_LISTS:
        for index, container in enumerate(spec.get(list_name) or []):
            if isinstance(container, dict):
                yield list_name, index, container


def requests_of(pod: dict[str, Any]) -> list[Request]:
    """Every non-zero resource request or limit of every container, one row per resource."""
    out: list[Request] = []
    for list_name, index, container in _containers(pod):
        resources = container.get("resources") or {}
        seen: set[str] = set()
        for part in ("limits", "requests"):
            for resource, quantity in (resources.get(part) or {}).items():
                if resource not in seen and nonzero(quantity):
                    seen.add(resource)
                    out.append(Request(list_name, index, str(container.get("name", "")), resource))
    return out


def pod_name(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    if meta.get("name"):
        return str(meta["name"])
    if meta.get("generateName"):
        return f"{meta['generateName']}*"
    return "(unnamed)"


def _void_env(list_name: str, index: int, container: dict[str, Any]) -> list[dict[str, Any]]:
    base = f"/spec/{list_name}/{index}/env"
    wanted = {"name": VISIBLE_DEVICES, "value": VOID}
    env = container.get("env")
    if not env:
        return [{"op": "add", "path": base, "value": [wanted]}]
    hits = [i for i, e in enumerate(env) if isinstance(e, dict) and e.get("name") == VISIBLE_DEVICES]
    if not hits:
        return [{"op": "add", "path": f"{base}/-", "value": wanted}]
    first, *rest = hits
    ops: list[dict[str, Any]] = []
    # Later duplicates first, so the indices of the earlier ones stay right.
    for i in reversed(rest):
        ops.append({"op": "remove", "path": f"{base}/{i}"})
    if env[first] != wanted:
        ops.append({"op": "replace", "path": f"{base}/{first}", "value": wanted})
    return ops


def mutate(pod: dict[str, Any], policy: Policy) -> list[dict[str, Any]]:
    """The JSONPatch for a pod (empty when nothing changes)."""
    requests = requests_of(pod)
    if not any(policy.is_gpu(r.resource) for r in requests):
        ops: list[dict[str, Any]] = []
        for list_name, index, container in _containers(pod):
            ops += _void_env(list_name, index, container)
        return ops
    spec = pod.get("spec") or {}
    if (policy.inject_runtime_class and policy.runtime_classes and not spec.get("runtimeClassName")
            and any(policy.is_passthrough(r.resource) for r in requests)):
        return [{"op": "add", "path": "/spec/runtimeClassName", "value": policy.runtime_classes[0]}]
    return []


def validate(pod: dict[str, Any], policy: Policy) -> str | None:
    """Why the pod is denied, or None when it is allowed."""
    passthrough = [r for r in requests_of(pod) if policy.is_passthrough(r.resource)]
    if not passthrough:
        return None
    runtime_class = (pod.get("spec") or {}).get("runtimeClassName")
    if runtime_class in policy.runtime_classes:
        return _confidential_problem(pod, runtime_class, passthrough, policy)
    first = passthrough[0]
    more = f" (and {len(passthrough) - 1} more passthrough request(s))" if len(passthrough) > 1 else ""
    has = f'runtimeClassName is "{runtime_class}"' if runtime_class else "it sets no runtimeClassName"
    classes = ", ".join(policy.runtime_classes)
    return (f'pod "{pod_name(pod)}": {first.where} requests the passthrough resource '
            f"{first.resource}{more}, but {has}; a passthrough GPU is only given to a Kata VM: "
            f"set spec.runtimeClassName to one of {classes}, or request nvidia.com/gpu for a "
            f"container GPU")


def _confidential_problem(pod: dict[str, Any], runtime_class: str, passthrough: list[Request],
                          policy: Policy) -> str | None:
    """A confidential class asking for a GPU model that never runs in CC mode: its VM's
    attestation of the GPU can never succeed, so the pod is refused now rather than left
    Pending for good."""
    if not policy.is_confidential(runtime_class):
        return None
    for request in passthrough:
        model = not_cc_capable_model(request.resource)
        if model:
            return (f'pod "{pod_name(pod)}": {request.where} requests {request.resource}, but runtimeClassName '
                    f'"{runtime_class}" runs confidential VMs and the GPU model {model} has no confidential-'
                    f"computing mode (Hopper and later only); use a non-confidential Kata class for it, or "
                    f"request a CC-capable GPU")
    return None
