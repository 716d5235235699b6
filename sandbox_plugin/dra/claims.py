"""A ResourceClaim as the kubelet names it, read from the API server, and the devices
it was allocated from this driver's pool on this node.

The kubelet sends only a claim's namespace, name and UID (DRA ``Claim``); what it
was allocated is in the claim's ``status.allocation.devices.results``
(resource.k8s.io/v1), one entry per device with the request it serves, the
driver, the pool and the device name. A node-local driver's pool is its node
(``spec.pool.name`` of its ResourceSlice), so the results this driver prepares
are those with ``driver`` ours and ``pool`` this node's.

The UID given must be the UID read: a claim deleted and created again under the
same name is another claim, whose allocation was made for another pod
(kubelet 1.35's DRA manager checks the same against its own cache,
pkg/kubelet/cm/dra/manager.go ``prepareResources``).

The pods a claim is for are its ``status.reservedFor`` entries of resource ``pods``
(the scheduler reserves the claim for the pod before binding it; the kubelet refuses
to prepare a claim not reserved for the pod). ``check_runtime_classes`` reads each
and its RuntimeClass, and refuses a pod outside a Kata GPU runtime class, judged by the
class's handler as the admission layers judge it (a Kata GPU runtime's handler, or a named
class with a Kata handler; a name alone is never enough: a class remade with handler runc
keeps its name): the claim's CDI names would put the raw VFIO device into a runc container.
Every pod in ``reservedFor`` is judged, on every prepare: a claim shared by several pods is
Kata's only while all of them are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kubernetes.client import ApiClient, CoreV1Api, NodeV1Api, ResourceV1Api
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from gpunode.kataclasses import KATA_GPU_HANDLERS, KATA_HANDLERS, kata_gpu_class_problem
from gpunode.services.kube import api_error_message

READ_TIMEOUT = 10.0  # seconds for one read of a claim


class ClaimError(Exception):
    """This claim cannot be prepared; the message is the claim's error for the kubelet."""


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"ResourceClaim {self.namespace}/{self.name}"


@dataclass(frozen=True)
class AllocatedDevice:
    request: str
    pool: str
    device: str


def read_claim(api: ApiClient, ref: ClaimRef, *, timeout: float = READ_TIMEOUT) -> dict:
    """The claim object; ClaimError when it cannot be read or its UID is not ``ref.uid``."""
    try:
        response = ResourceV1Api(api).read_namespaced_resource_claim(
            ref.name, ref.namespace, _preload_content=False, _request_timeout=timeout)
    except ApiException as e:
        if e.status == 404:
            raise ClaimError(f"{ref} does not exist (deleted before its pod started?)") from e
        hint = ("; grant the driver's service account get on resourceclaims"
                if e.status in (401, 403) else "")
        raise ClaimError(f"cannot read {ref}: {api_error_message(e)}{hint}") from e
    except HTTPError as e:
        raise ClaimError(f"cannot read {ref}: API server unreachable ({e})") from e
    claim = json.loads(response.data)
    uid = (claim.get("metadata") or {}).get("uid")
    if uid != ref.uid:
        raise ClaimError(
            f"{ref} has UID {uid}, not {ref.uid} as the kubelet asked: the claim was deleted and "
            "created again, so the kubelet's is stale")
    return claim


def our_devices(claim: dict, ref: ClaimRef, driver: str, pool: str) -> list[AllocatedDevice]:
    """The allocation's results of ``driver`` in ``pool``; ClaimError when there are none."""
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"{ref} is not allocated (status.allocation is empty)")
    results = (allocation.get("devices") or {}).get("results") or []
    ours = [AllocatedDevice(r.get("request", ""), r.get("pool", ""), r.get("device", ""))
            for r in results if r.get("driver") == driver and r.get("pool") == pool]
    if not ours:
        seen = ", ".join(sorted({f"{r.get('driver')} pool {r.get('pool')}" for r in results})) or "none"
        raise ClaimError(
            f"{ref} was allocated no device of driver {driver} in pool {pool} (its devices: {seen})")
    return ours


def check_runtime_classes(api: ApiClient, claim: dict, ref: ClaimRef, allowed: frozenset[str], *,
                          kata_handlers: tuple[str, ...] = KATA_HANDLERS,
                          gpu_handlers: tuple[str, ...] = KATA_GPU_HANDLERS,
                          timeout: float = READ_TIMEOUT) -> None:
    """ClaimError unless every pod the claim is reserved for runs in a Kata GPU runtime class,
    judged by the class's handler as read now (``gpunode.kataclasses.kata_gpu_class_problem``:
    a Kata GPU runtime's handler, or one of ``allowed`` with a Kata runtime's handler). A pod
    or class that cannot be read fails the claim: the kubelet asks again."""
    reserved = (claim.get("status") or {}).get("reservedFor") or []
    pods = [r for r in reserved if r.get("resource") == "pods" and not r.get("apiGroup")]
    if not pods:
        raise ClaimError(f"{ref} is reserved for no pod (status.reservedFor), so no pod may use it yet")
    handlers: dict[str, str | None] = {}
    for consumer in pods:
        name = consumer.get("name", "")
        try:
            pod = CoreV1Api(api).read_namespaced_pod(name, ref.namespace, _preload_content=False,
                                                     _request_timeout=timeout)
        except ApiException as e:
            hint = "; grant the driver's service account get on pods" if e.status in (401, 403) else ""
            raise ClaimError(f"{ref}: cannot read its pod {ref.namespace}/{name}: "
                             f"{api_error_message(e)}{hint}") from e
        except HTTPError as e:
            raise ClaimError(f"{ref}: cannot read its pod {ref.namespace}/{name}: API server "
                             f"unreachable ({e})") from e
        runtime_class = (json.loads(pod.data).get("spec") or {}).get("runtimeClassName")
        fix = ("; set runtimeClassName to a Kata GPU runtime class (one whose handler is a Kata GPU "
               f"runtime's: {', '.join(gpu_handlers)}, or one of {', '.join(sorted(allowed))} "
               "with a Kata handler)")
        if not runtime_class:
            raise ClaimError(
                f"{ref}: pod {ref.namespace}/{name} runs in runtime class (none: runc), not a Kata "
                "one: its containers would get the GPU's raw VFIO device" + fix)
        if runtime_class not in handlers:
            handlers[runtime_class] = _handler_of(api, ref, runtime_class, timeout)
        problem = kata_gpu_class_problem(runtime_class, handlers[runtime_class], named=allowed,
                                         kata_handlers=kata_handlers, gpu_handlers=gpu_handlers)
        if problem:
            raise ClaimError(
                f"{ref}: pod {ref.namespace}/{name}: {problem}, so its containers would get the "
                "GPU's raw VFIO device" + fix)


def _handler_of(api: ApiClient, ref: ClaimRef, name: str, timeout: float) -> str | None:
    """The handler of RuntimeClass ``name`` (None: there is none); ClaimError when it cannot be
    read, so the claim fails closed and the kubelet asks again."""
    try:
        return NodeV1Api(api).read_runtime_class(name, _request_timeout=timeout).handler or ""
    except ApiException as e:
        if e.status == 404:
            return None
        hint = "; grant the driver's service account get on runtimeclasses" if e.status in (401, 403) else ""
        raise ClaimError(f"{ref}: cannot read RuntimeClass {name}: {api_error_message(e)}{hint}") from e
    except HTTPError as e:
        raise ClaimError(f"{ref}: cannot read RuntimeClass {name}: API server unreachable ({e})") from e
