"""The pods of our node that ended Failed, read for the agent's rejected-pods report
(``katamgr.agent.rejected``): one list with the field selectors ``spec.nodeName`` and
``status.phase``, both of which the API server offers for pods
(k8s.io/kubernetes pkg/registry/core/pod/strategy.go, ``PodToSelectableFields``)."""

from __future__ import annotations

from dataclasses import dataclass

from kubernetes.client import ApiClient, CoreV1Api

from gpunode.services.kube import READ_TIMEOUT
from katamgr.cluster.nodes import node_call


@dataclass(frozen=True)
class FailedPod:
    """A Failed pod as the kubelet left it: its ``status.reason`` and ``message``, the extended
    resources its containers ask for, and its controller (``Kind/name``; None: a bare pod)."""

    namespace: str
    name: str
    uid: str
    reason: str
    message: str
    resources: tuple[str, ...]
    controller: str | None


def failed_pods_on_node(api: ApiClient, node_name: str) -> list[FailedPod]:
    """Every pod bound to ``node_name`` in phase Failed; a GpuNodeError when they cannot be listed."""
    with node_call(f"list the failed pods of node {node_name}",
                   "list on pods (the chart does with sandboxDevicePlugin.rejectedPods: event)"):
        answer = CoreV1Api(api).list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={node_name},status.phase=Failed", _request_timeout=READ_TIMEOUT)
    found = []
    for pod in answer.items or ():
        meta, spec, status = pod.metadata, pod.spec, pod.status
        asked: set[str] = set()
        for container in [*(spec.containers or ()), *(spec.init_containers or ())]:
            res = container.resources
            for amounts in (res.limits, res.requests) if res is not None else ():
                asked.update(amounts or {})
        owner = next((f"{o.kind}/{o.name}" for o in meta.owner_references or () if o.controller), None)
        found.append(FailedPod(meta.namespace, meta.name, meta.uid or "", (status.reason if status else None) or "",
                               (status.message if status else None) or "", tuple(sorted(asked)), owner))
    return found
