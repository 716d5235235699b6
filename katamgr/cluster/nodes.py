"""Our node's workload label, read through the API (the rule that uses it: ``katamgr.host.workload``)."""

from __future__ import annotations

from kubernetes.client import ApiClient, CoreV1Api
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from katamgr.cluster.client import api_error_message
from katamgr.errors import KatamgrError
from katamgr.host.workload import DEFAULT_WORKLOAD, WORKLOAD_LABEL, Workload, workload_from_label


def node_workload_mode(api: ApiClient, node_name: str,
                       default: Workload | str | None = DEFAULT_WORKLOAD) -> Workload | None:
    """The node's ``nvidia.com/gpu.workload.config`` label; ``default`` when it has none
    (the GPU Operator's ``sandboxWorkloads.defaultWorkload``). A value that names no
    workload is a ConfigError; a node the API cannot give us a KatamgrError."""
    mode = workload_from_label(node_name, _read_labels(api, node_name).get(WORKLOAD_LABEL))
    if mode is None and default is not None:
        return Workload(default)
    return mode


def _read_labels(api: ApiClient, node_name: str) -> dict[str, str]:
    try:
        node = CoreV1Api(api).read_node(node_name)
    except ApiException as e:
        if e.status == 404:
            raise KatamgrError(
                f"node {node_name} does not exist in the cluster; set NODE_NAME to this node's "
                "name (spec.nodeName through the downward API)"
            ) from e
        raise _failure(f"read node {node_name}", e) from e
    except HTTPError as e:
        raise KatamgrError(f"cannot read node {node_name}: API server unreachable ({e})") from e
    return dict((node.metadata.labels if node.metadata else None) or {})


def _failure(action: str, error: ApiException) -> KatamgrError:
    hint = "; grant the agent's service account get on nodes" if error.status in (401, 403) else ""
    return KatamgrError(f"cannot {action}: {api_error_message(error)}{hint}")
