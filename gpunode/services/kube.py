"""Our own Node's labels through the Kubernetes API: read once, or followed by a watch.

Both programs decide by their Node's labels (the workload label and the GPU Operator's
deploy labels, ``gpunode.policy.workload``): ``katamgr`` with the client its cluster layer
connects, ``sandbox-device-plugin`` (which may not import that layer) with one of its own.
This module is the one reader both use. It is the only part of ``gpunode.host`` that
talks to the API server, and it only reads one Node; everything else about the cluster
stays in ``katamgr.cluster``.

Following (``NodeLabelWatch``) is a watch on the Node, the way ``kubectl get node N -w``
does it: a list watch with the field selector ``metadata.name=<node>``, each request
ended by the server after ``timeoutSeconds`` (or by us once it stays silent past the
period of the server's bookmarks) and resumed from the last ``resourceVersion`` seen, so no
change between two requests is lost. A 410 Gone (that version is older than the server
keeps) starts over from a fresh read of the Node. Any other failure (no ``watch`` right,
an API server that went away, a broken stream) falls back to polling: the Node is read
every ``poll_interval`` and the watch is tried again after each read. Two watch requests
start at least ``min_watch_interval`` (1 s) apart, so a server or proxy that ends every
stream at once is asked about once a second, not as fast as the loop can reconnect; a
change in between is not lost (the next request resumes from the last version seen).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kubernetes.client import ApiClient, CoreV1Api
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines
from urllib3.exceptions import HTTPError, ReadTimeoutError

from gpunode.errors import GpuNodeError

log = logging.getLogger(__name__)

READ_TIMEOUT = 10.0  # seconds for one read of the Node (connect, then the answer)
# Seconds the server keeps one watch request open (timeoutSeconds): the API server's own
# --min-request-timeout default, what it gives a watch that names none. At rest a watch costs
# one request per period, so 1,800 s is 2 requests an hour per watcher (bench/bench_fleet.py).
WATCH_TIMEOUT = 1800
# Seconds a watch stream may stay silent before it is taken for dead and resumed. The API
# server's watch cache sends each watcher that allows bookmarks a BOOKMARK about once a
# minute (k8s.io/apiserver cacher: bookmarkFrequency, one minute; seen every 60 s on
# the 1.35 API server of tests/controlplane), so a stream quiet for longer lost its peer.
SILENCE_LIMIT = 150.0
POLL_INTERVAL = 10.0  # seconds between reads while the watch fails
MIN_WATCH_INTERVAL = 1.0  # seconds at least between the starts of two watch requests
GONE = 410


def api_error_message(error: ApiException) -> str:
    """The API server's own words for a failed call (its Status message), with the code."""
    message = ""
    try:
        status = json.loads(error.body or "")
        if isinstance(status, dict):
            message = str(status.get("message") or "")
    except ValueError:
        message = (error.body or "").strip()[:200]
    return f"HTTP {error.status} {error.reason}" + (f": {message}" if message else "")


@dataclass(frozen=True)
class NodeLabels:
    labels: Mapping[str, str]
    resource_version: str | None  # where a watch of the Node starts from


def read_node(api: ApiClient, node_name: str, *, timeout: float = READ_TIMEOUT) -> NodeLabels:
    """The Node's labels now. A Node that does not exist, a refusal or an API server that
    does not answer within ``timeout`` is a GpuNodeError naming the fix."""
    try:
        node = CoreV1Api(api).read_node(node_name, _request_timeout=timeout)
    except ApiException as e:
        if e.status == 404:
            raise GpuNodeError(
                f"node {node_name} does not exist in the cluster; set NODE_NAME to this node's "
                "name (spec.nodeName through the downward API)"
            ) from e
        hint = "; grant this service account get on nodes" if e.status in (401, 403) else ""
        raise GpuNodeError(f"cannot read node {node_name}: {api_error_message(e)}{hint}") from e
    except HTTPError as e:
        raise GpuNodeError(f"cannot read node {node_name}: API server unreachable ({e})") from e
    meta = node.metadata
    return NodeLabels(dict((meta.labels if meta else None) or {}), meta.resource_version if meta else None)


def read_node_labels(api: ApiClient, node_name: str, *, timeout: float = READ_TIMEOUT) -> dict[str, str]:
    return dict(read_node(api, node_name, timeout=timeout).labels)


class _Gone(Exception):
    """The watch's resourceVersion is older than the server keeps: read afresh."""


class NodeLabelWatch:
    """The latest labels of one Node, kept by a watch in a thread (the module doc says how).

    ``start()`` reads the Node once before it returns, so ``labels()`` has an answer at
    once; ``on_change()`` is called (from the watch thread) whenever the labels, or the
    failure to read them, change.
    """

    def __init__(self, api: ApiClient, node_name: str, *, on_change: Callable[[], None] | None = None,
                 poll_interval: float = POLL_INTERVAL, watch_timeout: int = WATCH_TIMEOUT,
                 read_timeout: float = READ_TIMEOUT, min_watch_interval: float = MIN_WATCH_INTERVAL,
                 silence_limit: float = SILENCE_LIMIT) -> None:
        self.api = api
        self.node_name = node_name
        self.on_change = on_change
        self.poll_interval = poll_interval
        self.watch_timeout = watch_timeout
        self.read_timeout = read_timeout
        self.min_watch_interval = min_watch_interval
        self.silence_limit = silence_limit
        self._last_watch: float | None = None  # monotonic start of the last watch request
        self._lock = threading.Lock()
        self._labels: dict[str, str] | None = None
        self._error: str | None = None
        self._stop = threading.Event()
        self._response = None  # the watch request in flight, closed by stop()
        self._thread: threading.Thread | None = None
        self._version: str | None = None
        self.watching = False  # a watch is open now (False: reading every poll_interval)
        self._watch_error: str | None = None  # the last watch failure, logged once

    # -- what callers ask -------------------------------------------------------

    def labels(self) -> dict[str, str]:
        """The Node's labels as last seen; a GpuNodeError while they cannot be read."""
        with self._lock:
            if self._error is not None or self._labels is None:
                raise GpuNodeError(self._error or f"node {self.node_name} has not been read yet")
            return dict(self._labels)

    def start(self) -> NodeLabelWatch:
        self._poll()
        self._thread = threading.Thread(target=self._run, name=f"watch node {self.node_name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            response = self._response
        if response is not None:
            # Shut the socket down under a read blocked on it (closing the response would
            # wait for that read); the watch thread then closes it.
            sock = getattr(getattr(response, "connection", None), "sock", None)
            try:
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- the watch thread -------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._version is None and not self._poll():
                self._stop.wait(self.poll_interval)
                continue
            if self._last_watch is not None:
                # However the last request ended (the server's timeoutSeconds, a proxy
                # closing the stream at once, a 410): no faster than min_watch_interval.
                spacing = self._last_watch + self.min_watch_interval - time.monotonic()
                if spacing > 0 and self._stop.wait(spacing):
                    break
            self._last_watch = time.monotonic()
            try:
                self._watch_once()
            except _Gone:
                log.info("the watch on node %s expired (410 Gone); reading the node afresh", self.node_name)
                self._version = None
            except Exception as exc:  # noqa: BLE001 - any failure: poll, then try the watch again
                if self._stop.is_set():
                    break
                self.watching = False
                why = str(exc) if isinstance(exc, GpuNodeError) else f"{type(exc).__name__}: {exc}"
                if why != self._watch_error:
                    log.warning("cannot watch node %s (%s); reading it every %g s instead",
                                self.node_name, why, self.poll_interval)
                self._watch_error = why
                self._version = None
                self._stop.wait(self.poll_interval)

    def _poll(self) -> bool:
        """Read the Node once; True when it answered."""
        try:
            read = read_node(self.api, self.node_name, timeout=self.read_timeout)
        except GpuNodeError as exc:
            self._publish(None, str(exc))
            return False
        self._version = read.resource_version
        self._publish(dict(read.labels), None)
        return True

    def _watch_once(self) -> None:
        """One watch request, from ``self._version`` until the server ends it."""
        try:
            response = CoreV1Api(self.api).list_node(
                field_selector=f"metadata.name={self.node_name}", watch=True,
                resource_version=self._version, timeout_seconds=self.watch_timeout,
                allow_watch_bookmarks=True, _preload_content=False,
                _request_timeout=(self.read_timeout,
                                  min(self.silence_limit, self.watch_timeout + self.read_timeout)))
        except ApiException as e:
            if e.status == GONE:
                raise _Gone() from e
            hint = "; grant this service account watch on nodes" if e.status in (401, 403) else ""
            raise GpuNodeError(api_error_message(e) + hint) from e
        with self._lock:
            self._response = response
        try:
            if self._watch_error is not None:
                log.info("watching node %s again", self.node_name)
                self._watch_error = None
            self.watching = True
            for line in iter_resp_lines(response):
                if self._stop.is_set():
                    return
                if line:
                    self._event(json.loads(line))
        except ReadTimeoutError:
            # Silent past the bookmarks' period: resumed from the last version seen, as after
            # the server's timeoutSeconds (an API server sending no periodic bookmarks costs a
            # request per silence_limit instead).
            log.debug("the watch on node %s was silent for %g s; resuming it", self.node_name,
                      self.silence_limit)
        finally:
            with self._lock:
                self._response = None
            response.close()
            response.release_conn()

    def _event(self, event: Mapping) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == GONE:
                raise _Gone()
            raise GpuNodeError(f"the watch ended with HTTP {obj.get('code')}: {obj.get('message')}")
        meta = obj.get("metadata") or {}
        self._version = meta.get("resourceVersion") or self._version
        if kind in ("ADDED", "MODIFIED"):
            self._publish(dict(meta.get("labels") or {}), None)
        elif kind == "DELETED":
            self._publish(None, f"node {self.node_name} was deleted from the cluster")

    def _publish(self, labels: dict[str, str] | None, error: str | None) -> None:
        with self._lock:
            changed = error != self._error or (labels is not None and labels != self._labels)
            if labels is not None:
                self._labels = labels
            self._error = error
        if changed and self.on_change is not None:
            self.on_change()

