"""Our Node conditions, read and written through the ``nodes/status`` subresource.

A strategic merge patch of ``status.conditions`` merges by ``type`` (NodeStatus.Conditions'
patchMergeKey in k8s.io/api core/v1 types.go), so the patch carries only our condition types
and leaves the kubelet's (Ready, MemoryPressure, ...) and node-problem-detector's as they
are, which a merge patch (lists replaced whole) or a JSON patch (by index) would not.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from kubernetes.client import ApiClient, CoreV1Api

from gpunode.services.kube import READ_TIMEOUT
from katamgr.cluster.nodes import node_call

STRATEGIC_MERGE = "application/strategic-merge-patch+json"
FIELDS = ("type", "status", "reason", "message", "lastHeartbeatTime", "lastTransitionTime")


def read_node_conditions(api: ApiClient, node_name: str, types: Iterable[str]) -> dict[str, dict[str, str]]:
    """The Node's conditions of ``types``, by type, in the API's wire form."""
    wanted = set(types)
    with node_call(f"read node {node_name}"):
        raw = CoreV1Api(api).read_node(node_name, _request_timeout=READ_TIMEOUT, _preload_content=False)
    node = json.loads(raw.data)
    found = {}
    for c in (node.get("status") or {}).get("conditions") or []:
        if c.get("type") in wanted:
            found[c["type"]] = {k: c[k] for k in FIELDS if c.get(k) is not None}
    return found


def patch_node_conditions(api: ApiClient, node_name: str, conditions: list[dict[str, str]]) -> None:
    """Set these conditions (whole, each by its type) on the Node's status, touching no other."""
    body = {"status": {"conditions": conditions}}
    with node_call(f"set conditions on node {node_name}", "patch on nodes/status (the chart does)"):
        CoreV1Api(api).patch_node_status(node_name, body, _content_type=STRATEGIC_MERGE,
                                         _request_timeout=READ_TIMEOUT)
