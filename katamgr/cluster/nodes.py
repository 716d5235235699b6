"""The node's workload mode label and other labels we set on our node."""

from __future__ import annotations

import logging

from kubernetes.client import ApiClient, CoreV1Api
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from katamgr.cluster.client import api_error_message
from katamgr.config import WORKLOAD_CONFIG_LABEL, label_key_problem, label_value_problem
from katamgr.errors import ConfigError, KatamgrError

log = logging.getLogger(__name__)

WORKLOAD_MODES = ("container", "vm-passthrough", "vm-vgpu")
DEFAULT_WORKLOAD_MODE = "container"


def node_workload_mode(api: ApiClient, node_name: str, default: str = DEFAULT_WORKLOAD_MODE) -> str:
    """The node's ``nvidia.com/gpu.workload.config`` label; ``default`` when it has none
    (the GPU Operator's ``sandboxWorkloads.defaultWorkload``)."""
    labels = _read_labels(api, node_name)
    mode = labels.get(WORKLOAD_CONFIG_LABEL)
    if mode is None or mode == "":
        return default
    if mode not in WORKLOAD_MODES:
        raise ConfigError(
            f"node {node_name} has label {WORKLOAD_CONFIG_LABEL}={mode!r}, which is not a "
            f"workload mode; set it to one of {', '.join(WORKLOAD_MODES)}"
        )
    return mode


def set_node_label(api: ApiClient, node_name: str, key: str, value: str | None) -> bool:
    """Set (or, with None, remove) one label on the node; True when the node changed."""
    if problem := label_key_problem(key):
        raise ConfigError(f"{key!r} is not a valid label key: {problem}")
    if value is not None and (problem := label_value_problem(value)):
        raise ConfigError(f"{value!r} is not a valid value for label {key}: {problem}")
    if _read_labels(api, node_name).get(key) == value:
        return False
    try:
        # A JSON merge patch touches only this key (null removes it).
        CoreV1Api(api).patch_node(
            node_name,
            {"metadata": {"labels": {key: value}}},
            _content_type="application/merge-patch+json",
        )
    except ApiException as e:
        raise _failure(f"label node {node_name}", e) from e
    except HTTPError as e:
        raise KatamgrError(f"cannot label node {node_name}: API server unreachable ({e})") from e
    if value is None:
        log.info("removed label %s from node %s", key, node_name)
    else:
        log.info("labeled node %s %s=%s", node_name, key, value)
    return True


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
    hint = "; grant the agent's service account get/patch on nodes" if error.status in (
        401, 403) else ""
    return KatamgrError(f"cannot {action}: {api_error_message(error)}{hint}")
