"""The only layer that talks to the Kubernetes API.

Every function takes an ``ApiClient`` from ``gpunode.services.apiclient.connect()`` (or a test's client
pointed at a stand-in API server) and returns dataclasses, never raw API models.
"""

from katamgr.cluster.client import (
    FIELD_MANAGER,
    MANAGED_BY_LABEL,
    MANAGED_BY_VALUE,
    agent_namespace,
)
from katamgr.cluster.events import EventRecorder, ObjectRef, record_event
from katamgr.cluster.nodes import node_resources, node_workload_mode, set_node_labels
from katamgr.cluster.runtimeclasses import (
    RuntimeClassChanges,
    delete_managed_runtime_classes,
    desired_runtime_classes,
    reconcile_runtime_classes,
)
from katamgr.cluster.secrets import read_pull_secret

__all__ = [
    "EventRecorder",
    "FIELD_MANAGER",
    "MANAGED_BY_LABEL",
    "MANAGED_BY_VALUE",
    "ObjectRef",
    "RuntimeClassChanges",
    "agent_namespace",
    "delete_managed_runtime_classes",
    "desired_runtime_classes",
    "node_resources",
    "node_workload_mode",
    "read_pull_secret",
    "reconcile_runtime_classes",
    "set_node_labels",
    "record_event",
]
