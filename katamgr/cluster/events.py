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

from katamgr.cluster.client import FIELD_MANAGER
from katamgr.node.kube import api_error_message

log = logging.getLogger(__name__)

EVENT_TYPES = ("Normal", "Warning")
MAX_MESSAGE = 1024  # the API server rejects longer event messages
# The API server accepts a core/v1 Event about a cluster-scoped object (a Node) only in
# "default" ("involvedObject.namespace: does not match event.namespace" otherwise: the
# Event validation in kubernetes pkg/apis/core/validation/events.go), which is where
# the kubelet and client-go's recorder put Node events.
NODE_EVENTS_NAMESPACE = "default"


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


class EventRecorder:
    """Events on one Node, de-duplicated and rate-limited, for a loop that may fail
    the same way every few seconds: the same type, reason and message within
    ``window`` seconds is recorded once, and at most ``burst`` events are written
    per ``window`` in all (the rest are logged and dropped)."""

    def __init__(self, api: ApiClient, node_name: str, *, namespace: str = NODE_EVENTS_NAMESPACE,
                 window: float = 600.0, burst: int = 20, clock=time.monotonic) -> None:
        # kubelet's convention for Node events (kubectl describe node finds them by it).
        self.node = ObjectRef("Node", node_name, uid=node_name)
        self.api = api
        self.namespace = namespace
        self.window = window
        self.burst = burst
        self.clock = clock
        self._seen: dict[tuple[str, str, str], float] = {}
        self._written: list[float] = []

    def record(self, reason: str, message: str, type: str = "Normal") -> bool:  # noqa: A002
        """True when an Event was written; False when de-duplicated, rate-limited or failed."""
        now = self.clock()
        key = (type, reason, message[:MAX_MESSAGE])
        self._seen = {k: t for k, t in self._seen.items() if now - t < self.window}
        self._written = [t for t in self._written if now - t < self.window]
        if key in self._seen:
            return False
        if len(self._written) >= self.burst:
            log.info("not recording event %s (more than %d in %.0f s): %s", reason, self.burst, self.window, message)
            return False
        self._seen[key] = now
        self._written.append(now)
        return record_event(self.api, self.namespace, self.node, reason, message, type)
