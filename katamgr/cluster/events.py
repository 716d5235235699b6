"""Kubernetes Events, so `kubectl describe node` shows what the agent did.

Events are best effort: a failure to record one is logged and never fails
the work it describes. An Event the API server could not be reached for (a
restart, an outage across a relabel) is written again later, as client-go's
recorder does (k8s.io/client-go tools/record/event.go, recordToSink: up to 12
tries, 10 s apart, the first wait random; an answer from the server that
refuses the Event is not retried), with the time it happened.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
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

from gpunode.services.kube import api_error_message
from katamgr.cluster.client import FIELD_MANAGER

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


# client-go's recorder: tries per Event, and the wait between them.
MAX_TRIES = 12
RETRY_SECONDS = 10.0
WRITTEN, REFUSED, UNREACHABLE = "written", "refused", "unreachable"
# No answer (the client's own status 0), or the server saying "not now" (starting up,
# overloaded): client-go's REST client waits and retries those itself (rest/request.go,
# checkWait: 429 and 5xx with Retry-After), so the recorder sees them fail only after that.
RETRIED = frozenset({0, None, 429, 500, 502, 503, 504})
# What an API server that has just started answers until its admission plugins' informers
# have synced: 403 with this message (k8s.io/apiserver admission/plugin/namespace/lifecycle
# admission.go, policy/generic/plugin.go, webhook/generic/webhook.go). client-go's recorder
# drops the Event then; it is worth the next try here, as an API server restart is when
# Events pile up.
NOT_YET_READY = "not yet ready to handle request"


def _retried(e: ApiException) -> bool:
    return e.status in RETRIED or (e.status == 403 and NOT_YET_READY in str(e.body or ""))


def record_event(
    api: ApiClient,
    namespace: str,
    involved_object: ObjectRef,
    reason: str,
    message: str,
    type: str = "Normal",  # noqa: A002 - the Event field's name
) -> bool:
    """Record a core/v1 Event in ``namespace``; False (logged) when it could not be written."""
    return _send(api, namespace, involved_object, reason, message, type) == WRITTEN


def _send(api: ApiClient, namespace: str, involved_object: ObjectRef, reason: str, message: str,
          type: str, when: datetime | None = None, quiet: bool = False,  # noqa: A002
          name: str | None = None, repeat: tuple[str, int, datetime] | None = None) -> str:
    """WRITTEN, REFUSED (the server answered no) or UNREACHABLE (no answer, or "try again":
    worth a retry). ``repeat``: (name, count, first time) of the same Event written before,
    patched with the new count and time as client-go's EventCorrelator does."""
    if type not in EVENT_TYPES:
        raise ValueError(f"event type {type!r} is not one of {EVENT_TYPES}")
    now = when or datetime.now(UTC)
    if repeat is not None:
        outcome = _patch(api, namespace, involved_object, reason, repeat, now, quiet)
        if outcome != "gone":
            return outcome
    event = CoreV1Event(
        metadata=V1ObjectMeta(
            # client-go names events <object>.<hex nanoseconds>, unique per object.
            name=name or f"{involved_object.name}.{time.time_ns():x}",
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
    return _write(lambda: CoreV1Api(api).create_namespaced_event(namespace, event),
                  "record", reason, involved_object, quiet)


def _patch(api: ApiClient, namespace: str, involved_object: ObjectRef, reason: str,
           repeat: tuple[str, int, datetime], now: datetime, quiet: bool) -> str:
    name, count, _first = repeat
    body = {"count": count, "lastTimestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ")}
    # A 404: deleted meanwhile (events expire), so written afresh, as client-go does.
    return _write(lambda: CoreV1Api(api).patch_namespaced_event(name, namespace, body),
                  "update", reason, involved_object, quiet, gone_on_404=True)


def _write(call, verb: str, reason: str, involved_object: ObjectRef, quiet: bool,
           gone_on_404: bool = False) -> str:
    """WRITTEN, REFUSED (logged), UNREACHABLE (worth a retry) or "gone" for one API call."""
    try:
        call()
    except ApiException as e:
        if gone_on_404 and e.status == 404:
            return "gone"
        if _retried(e):
            return _unreachable(reason, involved_object, api_error_message(e) if e.status else str(e.reason), quiet)
        log.warning("could not %s event %s on %s %s: %s", verb, reason, involved_object.kind,
                    involved_object.name, api_error_message(e))
        return REFUSED
    except HTTPError as e:
        return _unreachable(reason, involved_object, str(e), quiet)
    return WRITTEN


def _unreachable(reason: str, involved_object: ObjectRef, why: str, quiet: bool) -> str:
    if not quiet:
        log.warning("could not record event %s on %s %s: %s; trying again every %g s",
                    reason, involved_object.kind, involved_object.name, why, RETRY_SECONDS)
    return UNREACHABLE


def _host() -> str:
    return os.environ.get("NODE_NAME") or socket.gethostname()


class EventRecorder:
    """Events on one Node, correlated and rate-limited, for a loop that may fail the same
    way every few seconds: the same type, reason and message within ``window`` seconds is
    one Event whose ``count`` and ``lastTimestamp`` are patched (client-go's EventCorrelator,
    tools/record/events_cache.go, eventObserve), and at most ``burst`` writes are made per
    ``window`` in all (the rest are logged and dropped)."""

    def __init__(self, api: ApiClient, node_name: str, *, namespace: str = NODE_EVENTS_NAMESPACE,
                 window: float = 600.0, burst: int = 20, clock=time.monotonic,
                 retry_seconds: float = RETRY_SECONDS) -> None:
        # kubelet's convention for Node events (kubectl describe node finds them by it).
        self.node = ObjectRef("Node", node_name, uid=node_name)
        self.api = api
        self.namespace = namespace
        self.window = window
        self.burst = burst
        self.clock = clock
        # (type, reason, message) -> (last time, Event name, count, first time)
        self._seen: dict[tuple[str, str, str], tuple[float, str, int, datetime]] = {}
        self._written: list[float] = []
        self.retry_seconds = retry_seconds
        # Events the API server could not be reached for: (reason, message, type, when, tries).
        self._pending: list[tuple[str, str, str, datetime, int]] = []
        self._pending_lock = threading.Lock()
        self._retrier: threading.Thread | None = None

    def record(self, reason: str, message: str, type: str = "Normal",  # noqa: A002
               limited: bool = True) -> bool:
        """True when an Event was written (a repeat: its count raised); False when
        rate-limited or failed. ``limited=False``: an Event that happens once per operator
        action (a workload switch, a give-back), never dropped for the burst of others."""
        now = self.clock()
        key = (type, reason, message[:MAX_MESSAGE])
        self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.window}
        self._written = [t for t in self._written if now - t < self.window]
        if limited and len(self._written) >= self.burst:
            log.info("not recording event %s (more than %d in %.0f s): %s", reason, self.burst, self.window, message)
            return False
        self._written.append(now)
        when = datetime.now(UTC)
        seen = self._seen.get(key)
        if seen is not None:
            _, name, count, first = seen
            self._seen[key] = (now, name, count + 1, first)
            outcome = _send(self.api, self.namespace, self.node, reason, message, type, when,
                            name=name, repeat=(name, count + 1, first))
        else:
            name = f"{self.node.name}.{time.time_ns():x}"
            self._seen[key] = (now, name, 1, when)
            outcome = _send(self.api, self.namespace, self.node, reason, message, type, when, name=name)
        if outcome == UNREACHABLE:
            self._keep(reason, message, type, when)
        return outcome == WRITTEN

    @property
    def pending(self) -> int:
        """Events waiting for the API server."""
        with self._pending_lock:
            return len(self._pending)

    def _keep(self, reason: str, message: str, type: str, when: datetime) -> None:  # noqa: A002
        with self._pending_lock:
            self._pending.append((reason, message, type, when, 1))
            if self._retrier is None or not self._retrier.is_alive():
                self._retrier = threading.Thread(target=self._retry, name="event-retry", daemon=True)
                self._retrier.start()

    def _retry(self) -> None:
        """Write the kept Events again, oldest first, until none is left."""
        delay = self.retry_seconds * random.random()  # noqa: S311 - spreading nodes out, not secrecy
        while True:
            time.sleep(delay)
            delay = self.retry_seconds
            with self._pending_lock:
                batch, self._pending = self._pending, []
            left = []
            for i, (reason, message, type_, when, tries) in enumerate(batch):
                outcome = _send(self.api, self.namespace, self.node, reason, message, type_, when, quiet=True)
                if outcome == UNREACHABLE:
                    if tries + 1 < MAX_TRIES:
                        left.append((reason, message, type_, when, tries + 1))
                    else:
                        log.warning("gave up recording event %s on Node %s after %d tries: %s",
                                    reason, self.node.name, MAX_TRIES, message)
                    left += [(r, m, t, w, n) for r, m, t, w, n in batch[i + 1:]]  # still down: later
                    break
                if outcome == WRITTEN:
                    log.info("recorded event %s on Node %s after the API server came back", reason, self.node.name)
            with self._pending_lock:
                self._pending = left + self._pending
                if not self._pending:
                    self._retrier = None
                    return
