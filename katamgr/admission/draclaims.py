"""The webhook's rules for passthrough GPUs given through DRA (the chart's ``dra.enabled``):
a ResourceClaim of the DRA driver's passthrough devices is Kata's at every step the API
server sees.

- **A pod's create** (``/validate``): each ``spec.resourceClaims`` entry names a claim
  (``resourceClaimName``, read from the API server) or a template
  (``resourceClaimTemplateName``, read too; the claim the resourceclaim controller makes from
  it has the template's spec). One that requests a passthrough DeviceClass (``exactly`` or a
  ``firstAvailable`` subrequest naming one of ours), or that is already allocated devices of
  our driver, needs the pod in a Kata GPU runtime class, judged as for a passthrough
  resource (by the class's handler where the webhook reads RuntimeClasses). A claim that
  does not exist yet is left to the next step.
- **A claim's reservation** (``resourceclaims/status``, ``/validate``): kube-scheduler's DRA
  plugin writes ``status.allocation`` and adds the pod to ``status.reservedFor`` through
  the status subresource in PreBind, before the pod is bound; the kubelet prepares a claim
  once for all the pods it is reserved for (kubelet 1.35 pkg/kubelet/cm/dra/manager.go skips
  a claim it holds as prepared), so a pod that shares a Kata pod's claim by name would get
  its CDI devices (``/dev/vfio/vfio`` and the group) without the driver being asked. Every
  pod a write adds to ``reservedFor`` of a claim holding devices of our driver is read, and
  the write refused unless the pod is in a Kata GPU class: the scheduler's PreBind fails,
  and the pod stays Pending with the reason in its events. Entries removed, and claims of
  other drivers, are never judged.

Every read that fails is a denial (fail closed, as the webhook's failurePolicy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Protocol

from gpunode.kataclasses import kata_gpu_class_problem
from katamgr.admission.podparts import pod_name

Read = Callable[[str, str], "dict[str, Any] | None"]  # (namespace, name) -> object, None: none
CLAIM_KIND = ("resource.k8s.io", "ResourceClaim")
STATUS = "status"


class ClassPolicy(Protocol):
    """What of ``rules.Policy`` judges a runtime class."""

    runtime_classes: tuple[str, ...]
    kata_handlers: tuple[str, ...]
    gpu_handlers: tuple[str, ...]
    handler_of: Callable[[str], str | None] | None

    def kata_classes(self) -> str: ...


@dataclass(frozen=True)
class DraChecks:
    driver: str  # the DRA driver whose devices are passthrough GPUs
    device_classes: tuple[str, ...]  # the DeviceClasses that select them
    claim_of: Read
    template_of: Read
    pod_of: Read

    def requests_ours(self, spec: Any) -> bool:
        """Whether a claim's spec asks for a passthrough DeviceClass (resource.k8s.io/v1)."""
        requests = _get(_get(spec, "devices"), "requests")
        for request in requests if isinstance(requests, list) else ():
            names = [_get(_get(request, "exactly"), "deviceClassName"),
                     _get(request, "deviceClassName")]  # v1beta1's place, as the safe side
            sub = _get(request, "firstAvailable")
            names += [_get(s, "deviceClassName") for s in (sub if isinstance(sub, list) else ())]
            if any(isinstance(n, str) and n in self.device_classes for n in names):
                return True
        return False

    def allocated_ours(self, claim: Any) -> bool:
        results = _get(_get(_get(_get(claim, "status"), "allocation"), "devices"), "results")
        return any(_get(r, "driver") == self.driver for r in (results if isinstance(results, list) else ()))


def _get(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, dict) else None


def class_problem(runtime_class: Any, policy: ClassPolicy) -> str | None:
    """Why a pod of ``runtime_class`` may not have a passthrough GPU (None: it may)."""
    if not runtime_class:
        return "the pod sets no runtimeClassName (runc)"
    if not isinstance(runtime_class, str):
        return "its runtimeClassName is not a string"
    if policy.handler_of is None:  # judged by name: kata-deploy names each class after its handler
        if runtime_class in policy.runtime_classes or any(
                fnmatchcase(runtime_class, p) for p in policy.gpu_handlers):
            return None
        return f'runtimeClassName "{runtime_class}" is not a Kata GPU class'
    return kata_gpu_class_problem(runtime_class, policy.handler_of(runtime_class),
                                  named=policy.runtime_classes, kata_handlers=policy.kata_handlers,
                                  gpu_handlers=policy.gpu_handlers)


def _fix(policy: ClassPolicy) -> str:
    return (f"; a passthrough GPU is only given to a Kata VM: set spec.runtimeClassName to "
            f"{policy.kata_classes()}, or use a claim of a container GPU DeviceClass")


def pod_problem(pod: dict[str, Any], namespace: str, policy: ClassPolicy, dra: DraChecks) -> str | None:
    """Why the create of a pod in ``namespace`` is refused for the claims it names (None:
    allowed)."""
    spec = _get(pod, "spec")
    entries = _get(spec, "resourceClaims")
    if not isinstance(entries, list) or not entries:
        return None
    for entry in entries:
        claim_name, template_name = _get(entry, "resourceClaimName"), _get(entry, "resourceClaimTemplateName")
        if isinstance(claim_name, str) and claim_name:
            claim = dra.claim_of(namespace, claim_name)
            what = f'ResourceClaim "{claim_name}"'
            ours = claim is not None and (dra.requests_ours(_get(claim, "spec")) or dra.allocated_ours(claim))
        elif isinstance(template_name, str) and template_name:
            template = dra.template_of(namespace, template_name)
            what = f'ResourceClaimTemplate "{template_name}"'
            ours = template is not None and dra.requests_ours(_get(_get(template, "spec"), "spec"))
        else:
            continue
        if not ours:
            continue
        problem = class_problem(_get(spec, "runtimeClassName"), policy)
        if problem:
            return (f'pod "{pod_name(pod)}": its resourceClaims entry "{_get(entry, "name")}" names {what}, '
                    f"which requests passthrough GPUs of DRA driver {dra.driver}, but {problem}"
                    + _fix(policy))
    return None


def status_problem(request: dict[str, Any], policy: ClassPolicy, dra: DraChecks) -> str | None:
    """Why a write of a claim's status is refused (None: allowed): a pod added to the
    ``reservedFor`` of a claim allocated our devices, outside a Kata GPU class."""
    claim, old = request.get("object"), request.get("oldObject")
    if request.get("subResource") != STATUS or not dra.allocated_ours(claim):
        return None
    meta = _get(claim, "metadata")
    namespace, name = str(_get(meta, "namespace") or ""), str(_get(meta, "name") or "")
    before = {(_get(r, "uid"), _get(r, "name")) for r in _pods(old)}
    for entry in _pods(claim):
        pod_name, uid = str(_get(entry, "name") or ""), _get(entry, "uid")
        if (uid, _get(entry, "name")) in before:
            continue
        where = (f'ResourceClaim "{namespace}/{name}" holds passthrough GPUs of DRA driver {dra.driver}: '
                 f"pod {namespace}/{pod_name} may not be added to its reservedFor")
        pod = dra.pod_of(namespace, pod_name)
        if pod is None or _get(_get(pod, "metadata"), "uid") != uid:
            return f"{where}: there is no such pod (UID {uid})"
        problem = class_problem(_get(_get(pod, "spec"), "runtimeClassName"), policy)
        if problem:
            return f"{where}: {problem}" + _fix(policy)
    return None


def _pods(claim: Any) -> list[Any]:
    reserved = _get(_get(claim, "status"), "reservedFor")
    return [r for r in (reserved if isinstance(reserved, list) else ())
            if _get(r, "resource") == "pods" and not _get(r, "apiGroup")]


def is_claim(request: dict[str, Any]) -> bool:
    kind = request.get("kind")
    return isinstance(kind, dict) and (kind.get("group"), kind.get("kind")) == CLAIM_KIND
