"""Our node's workload label, read through the API (the rule that uses it: ``gpunode.policy.workload``;
the reader, shared with the device plugin, ``gpunode.services.kube``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from kubernetes.client import ApiClient, CoreV1Api
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from gpunode.errors import GpuNodeError
from gpunode.policy.workload import DEFAULT_WORKLOAD, WORKLOAD_LABEL, Workload, workload_from_label
from gpunode.services.kube import READ_TIMEOUT, api_error_message, read_node_labels


def node_workload_mode(api: ApiClient, node_name: str,
                       default: Workload | str | None = DEFAULT_WORKLOAD) -> Workload | None:
    """The node's ``nvidia.com/gpu.workload.config`` label; ``default`` when it has none
    (the GPU Operator's ``sandboxWorkloads.defaultWorkload``). A value that names no
    workload is a ConfigError; a node the API cannot give us a GpuNodeError."""
    mode = workload_from_label(node_name, read_node_labels(api, node_name).get(WORKLOAD_LABEL))
    if mode is None and default is not None:
        return Workload(default)
    return mode


@contextmanager
def node_call(what: str, grant: str = "") -> Iterator[None]:
    """An API call about our Node, its failure a GpuNodeError: ``what`` could not be done, why,
    and on a refusal (401, 403) ``grant``, the right this service account lacks."""
    try:
        yield
    except ApiException as e:
        hint = f"; grant this service account {grant}" if grant and e.status in (401, 403) else ""
        raise GpuNodeError(f"cannot {what}: {api_error_message(e)}{hint}") from e
    except HTTPError as e:
        raise GpuNodeError(f"cannot {what}: API server unreachable ({e})") from e


def set_node_labels(api: ApiClient, node_name: str, labels: Mapping[str, str | None]) -> None:
    """Set (or, for None, remove) labels on our Node with one merge patch; a refusal or an
    API server that does not answer is a GpuNodeError naming the fix."""
    with node_call(f"label node {node_name}", "patch on nodes (the chart does with ccManager.enabled)"):
        CoreV1Api(api).patch_node(node_name, {"metadata": {"labels": dict(labels)}},
                                  _request_timeout=READ_TIMEOUT)


def node_resources(api: ApiClient, node_name: str) -> tuple[dict[str, str], dict[str, str]]:
    """Our Node's ``status.capacity`` and ``status.allocatable``, as the kubelet last reported
    them; a GpuNodeError when the Node cannot be read."""
    with node_call(f"read node {node_name}"):
        node = CoreV1Api(api).read_node(node_name, _request_timeout=READ_TIMEOUT)
    status = node.status
    return dict((status.capacity if status else None) or {}), dict((status.allocatable if status else None) or {})
