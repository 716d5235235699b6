"""Our node's workload label, read through the API (the rule that uses it: ``katamgr.host.workload``;
the reader, shared with the device plugin, ``katamgr.node.kube``)."""

from __future__ import annotations

from kubernetes.client import ApiClient

from katamgr.host.workload import DEFAULT_WORKLOAD, WORKLOAD_LABEL, Workload, workload_from_label
from katamgr.node.kube import read_node_labels


def node_workload_mode(api: ApiClient, node_name: str,
                       default: Workload | str | None = DEFAULT_WORKLOAD) -> Workload | None:
    """The node's ``nvidia.com/gpu.workload.config`` label; ``default`` when it has none
    (the GPU Operator's ``sandboxWorkloads.defaultWorkload``). A value that names no
    workload is a ConfigError; a node the API cannot give us a KatamgrError."""
    mode = workload_from_label(node_name, read_node_labels(api, node_name).get(WORKLOAD_LABEL))
    if mode is None and default is not None:
        return Workload(default)
    return mode
