"""Kubernetes Events, so `kubectl describe node` shows what the agent did.

Events are best effort: a failure to record one is logged and never fails
the work it describes.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from kubernetes.client import (
    ApiClient,
    CoreV1Api,
    CoreV1Event,
    V1EventSource,
    V1ObjectMeta,
    V1ObjectReference,
)
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from katamgr.cluster.client import FIELD_MANAGER, api_error_message

log = logging.getLogger(__name__)

EVENT_TYPES = ("Normal", "Warning")
MAX_MESSAGE = 1024  # the API server rejects longer event messages


@dataclass(frozen=True)
class ObjectRef:
    """The object an event is about, e.g. ObjectRef("Node", "gpu-node-1")."""

    kind: str
    name: str
    namespace: str = ""
    uid: str = ""
    api_version: str = "v1"


def record_event(
    api: ApiClient,
    namespace: str,
    involved_object: ObjectRef,
    reason: str,
    message: str,
    type: str = "Normal",  # noqa: A002 - the Event field's name
) -> bool:
    """Record a core/v1 Event in ``namespace``; False (logged) when it could not be written."""
    if type not in EVENT_TYPES:
        raise ValueError(f"event type {type!r} is not one of {EVENT_TYPES}")
    now = datetime.now(UTC)
    event = CoreV1Event(
        metadata=V1ObjectMeta(
            # client-go names events <object>.<hex nanoseconds>, unique per object.
            name=f"{involved_object.name}.{time.time_ns():x}",
            namespace=namespace,
        ),
        involved_object=V1ObjectReference(
            kind=involved_object.kind,
            name=involved_object.name,
            namespace=involved_object.namespace or None,
            uid=involved_object.uid or None,
            api_version=involved_object.api_version,
        ),
        reason=reason,
        message=message[:MAX_MESSAGE],
        type=type,
        count=1,
        first_timestamp=now,
        last_timestamp=now,
        source=V1EventSource(component=FIELD_MANAGER, host=_host()),
        reporting_component=FIELD_MANAGER,
        reporting_instance=_host(),
    )
    try:
        CoreV1Api(api).create_namespaced_event(namespace, event)
    except ApiException as e:
        log.warning("could not record event %s on %s %s: %s", reason, involved_object.kind,
                    involved_object.name, api_error_message(e))
        return False
    except HTTPError as e:
        log.warning("could not record event %s on %s %s: %s", reason, involved_object.kind,
                    involved_object.name, e)
        return False
    return True


def _host() -> str:
    return os.environ.get("NODE_NAME") or socket.gethostname()
