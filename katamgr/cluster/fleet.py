"""Every node's state as the API holds it, for ``katamgr fleet``: read-only, one list of the
Nodes with the caller's own credentials (not the agent's: it may not list Nodes).

A node's unhealthy GPUs are its device-plugin resources' ``capacity`` less ``allocatable``:
the kubelet counts every device a plugin lists in capacity and only the Healthy ones in
allocatable (pkg/kubelet/cm/devicemanager: GetCapacity), so this needs no agent to ask.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kubernetes.client import ApiClient, CoreV1Api
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from gpunode.errors import GpuNodeError
from gpunode.kataclasses import OFFER_LABEL_PREFIX
from gpunode.policy.katadetect import RELEASE_LABEL
from gpunode.policy.workload import WORKLOAD_LABEL
from gpunode.services.kube import READ_TIMEOUT, api_error_message

CONDITION_PREFIX = "Sandbox"  # katamgr.agent.conditions' types
GPU_RESOURCE_PREFIX = "nvidia.com/"


@dataclass(frozen=True)
class NodeCondition:
    type: str
    status: str
    reason: str
    message: str
    last_transition_time: str


@dataclass(frozen=True)
class FleetNode:
    name: str
    workload: str | None  # the nvidia.com/gpu.workload.config label (None: none set)
    kata_version: str | None
    runtime_classes: list[str]  # offered here (our offer labels set to "true")
    conditions: list[NodeCondition]  # ours only
    unhealthy_gpus: dict[str, int]  # resource -> devices the kubelet counts but does not offer

    @property
    def last_transition(self) -> str | None:
        times = [c.last_transition_time for c in self.conditions if c.last_transition_time]
        return max(times) if times else None


def _node(raw: dict) -> FleetNode:
    meta, status = raw.get("metadata") or {}, raw.get("status") or {}
    labels = meta.get("labels") or {}
    capacity, allocatable = status.get("capacity") or {}, status.get("allocatable") or {}
    unhealthy = {}
    for resource, count in capacity.items():
        if resource.startswith(GPU_RESOURCE_PREFIX) and str(count).isdigit():
            left = str(allocatable.get(resource, "0"))
            gone = int(count) - (int(left) if left.isdigit() else 0)
            if gone > 0:
                unhealthy[resource] = gone
    conditions = [NodeCondition(c.get("type", ""), c.get("status", ""), c.get("reason", ""), c.get("message", ""),
                                c.get("lastTransitionTime", "") or "")
                  for c in status.get("conditions") or [] if str(c.get("type", "")).startswith(CONDITION_PREFIX)]
    return FleetNode(
        name=meta.get("name", ""), workload=labels.get(WORKLOAD_LABEL), kata_version=labels.get(RELEASE_LABEL),
        runtime_classes=sorted(k.removeprefix(OFFER_LABEL_PREFIX) for k, v in labels.items()
                               if k.startswith(OFFER_LABEL_PREFIX) and v == "true"),
        conditions=sorted(conditions, key=lambda c: c.type), unhealthy_gpus=dict(sorted(unhealthy.items())))


def read_fleet(api: ApiClient, label_selector: str = "") -> list[FleetNode]:
    """Every Node (those ``label_selector`` selects), by name."""
    try:
        raw = CoreV1Api(api).list_node(label_selector=label_selector or None, _request_timeout=READ_TIMEOUT * 3,
                                       _preload_content=False)
    except ApiException as e:
        hint = "; katamgr fleet needs list on nodes (a cluster reader's rights)" if e.status in (401, 403) else ""
        raise GpuNodeError(f"cannot list nodes: {api_error_message(e)}{hint}") from e
    except HTTPError as e:
        raise GpuNodeError(f"cannot list nodes: API server unreachable ({e})") from e
    items = json.loads(raw.data).get("items") or []
    return sorted((_node(item) for item in items), key=lambda n: n.name)
