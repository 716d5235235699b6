"""``gpunode.services.kube``: our Node's labels, read once and followed by a watch.

The watch is the API server's (k8s.io/apiserver ``pkg/endpoints/handlers/watch.go``, the
watch cache in ``pkg/storage/cacher``), met here by the stand-in's: a list watch with the
field selector ``metadata.name=<node>``, resumed from the last resourceVersion after the
server ends a request (``timeoutSeconds``), a 410 Expired for a version older than the
server keeps, and a 403 where the service account lacks the ``watch`` verb.
"""

from __future__ import annotations

import logging
import time

import pytest

from gpunode.errors import GpuNodeError
from gpunode.services.kube import NodeLabelWatch, read_node_labels

NODE = "gpu-1"


def seed(server, labels: dict[str, str]) -> None:
    server.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": labels}})
    server.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "other", "labels": {}}})


def label(server, key: str, value: str, name: str = NODE) -> None:
    server.update("nodes", name, lambda n: n["metadata"]["labels"].__setitem__(key, value))


def seen(watch: NodeLabelWatch, key: str, value: str, timeout: float = 5.0) -> float:
    """Seconds until the watch shows the label; fails after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if watch.labels().get(key) == value:
                return time.monotonic() - start
        except GpuNodeError:
            pass
        time.sleep(0.01)
    raise AssertionError(f"{key}={value} not seen in {timeout} s")


def test_a_read_names_a_missing_node_and_a_refusal(server, api):
    seed(server, {"a": "1"})
    assert read_node_labels(api, NODE) == {"a": "1"}
    with pytest.raises(GpuNodeError, match="node gpu-9 does not exist in the cluster; set NODE_NAME"):
        read_node_labels(api, "gpu-9")


def test_a_relabel_reaches_the_watch_at_once_and_only_this_node_is_watched(server, api):
    seed(server, {"a": "1"})
    changes = []
    watch = NodeLabelWatch(api, NODE, on_change=lambda: changes.append(1), poll_interval=30).start()
    try:
        assert watch.labels() == {"a": "1"}
        label(server, "a", "2")
        assert seen(watch, "a", "2") < 1.0
        assert watch.watching and changes
        # Another node's change is not ours: the field selector keeps it out.
        before = len(changes)
        label(server, "a", "x", name="other")
        time.sleep(0.2)
        assert watch.labels() == {"a": "2"} and len(changes) == before
        [request] = server.watches("nodes")[:1]
        assert request.query["fieldSelector"] == [f"metadata.name={NODE}"]
        assert int(request.query["timeoutSeconds"][0]) > 0  # every request is bounded
        # One read at start, then nothing but the watch: no polling while it works.
        reads = [r for r in server.requests if r.method == "GET" and r.path == f"/api/v1/nodes/{NODE}"]
        assert len(reads) == 1
    finally:
        watch.stop()


def test_the_watch_resumes_after_the_server_ends_it_and_rereads_after_410(server, api, caplog):
    caplog.set_level(logging.INFO, logger="gpunode.services.kube")
    seed(server, {"a": "1"})
    watch = NodeLabelWatch(api, NODE, poll_interval=30, watch_timeout=1, min_watch_interval=0.2).start()
    try:
        time.sleep(1.5)  # the server ended the first request after timeoutSeconds
        label(server, "a", "2")
        seen(watch, "a", "2")
        requests = server.watches("nodes")
        assert len(requests) >= 2
        # The next request resumes from the version the last one reached (nothing changed
        # in between here), not from a fresh read: nothing between two requests is lost.
        assert requests[1].query["resourceVersion"] == requests[0].query["resourceVersion"]
        reads = [r for r in server.requests if r.method == "GET" and r.path == f"/api/v1/nodes/{NODE}"]
        assert len(reads) == 1
        # Between two requests the node changes and the server forgets that history (etcd
        # compaction): resuming is answered 410 Expired, and the watch reads the node afresh.
        def change_and_compact(method, path):
            if path == "/api/v1/nodes" and server.on_request is not None:
                server.on_request = None
                label(server, "a", "3")
                server.compact()

        server.on_request = change_and_compact
        seen(watch, "a", "3", timeout=5)
        assert "expired (410 Gone); reading the node afresh" in caplog.text
        label(server, "a", "4")
        assert seen(watch, "a", "4") < 1.0  # and watches again
    finally:
        watch.stop()


def test_without_the_watch_verb_it_polls_and_says_so_once(server, api, caplog):
    seed(server, {"a": "1"})
    server.refuse_watch = 403
    watch = NodeLabelWatch(api, NODE, poll_interval=0.2).start()
    try:
        label(server, "a", "2")
        assert seen(watch, "a", "2") < 2.0
        assert not watch.watching
        time.sleep(0.5)
        refusals = [r for r in caplog.records if "cannot watch node gpu-1" in r.getMessage()]
        assert len(refusals) == 1
        assert "reading it every 0.2 s instead" in refusals[0].getMessage()
        assert "grant this service account watch on nodes" in refusals[0].getMessage()
        server.refuse_watch = None  # the right is granted: back to watching
        deadline = time.monotonic() + 3
        while not watch.watching and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch.watching
    finally:
        watch.stop()


def test_a_deleted_node_or_a_gone_server_is_an_error_not_stale_labels(server, api):
    seed(server, {"a": "1"})
    watch = NodeLabelWatch(api, NODE, poll_interval=0.2).start()
    try:
        server.remove("nodes", NODE)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                watch.labels()
            except GpuNodeError as exc:
                assert "gpu-1" in str(exc)
                break
            time.sleep(0.02)
        else:
            raise AssertionError("the deletion was not noticed")
    finally:
        started = time.monotonic()
        watch.stop()
        assert time.monotonic() - started < 2  # stop does not wait out the watch request


def test_a_server_that_ends_every_watch_at_once_is_not_hammered(server, api):
    """A proxy (or server) that closes each watch stream as soon as it opens: the watch
    reconnects no faster than min_watch_interval, and still sees every change."""
    seed(server, {"a": "1"})
    # timeoutSeconds=0: the stand-in ends each request the moment it has started.
    spaced = NodeLabelWatch(api, NODE, poll_interval=30, watch_timeout=0, min_watch_interval=0.25).start()
    try:
        time.sleep(1.5)
        requests = len(server.watches("nodes"))
        assert 3 <= requests <= 8, requests  # about one per 0.25 s, not hundreds
        label(server, "a", "2")
        assert seen(spaced, "a", "2") < 1.0  # resumed from the last version: nothing lost
    finally:
        spaced.stop()
    # The same server with no spacing: what the interval holds back.
    server.clear_log()
    eager = NodeLabelWatch(api, NODE, poll_interval=30, watch_timeout=0, min_watch_interval=0).start()
    try:
        time.sleep(0.5)
    finally:
        eager.stop()
    assert len(server.watches("nodes")) > 20


def test_the_default_spacing_is_a_second(server, api):
    seed(server, {"a": "1"})
    watch = NodeLabelWatch(api, NODE, poll_interval=30, watch_timeout=0).start()
    try:
        time.sleep(2.5)
    finally:
        watch.stop()
    assert 2 <= len(server.watches("nodes")) <= 4


def test_a_silent_stream_is_resumed_quietly_from_its_version_not_polled(server, api, caplog):
    # The API server's watch cache sends a BOOKMARK about once a minute to a watcher that allows
    # them (k8s.io/apiserver cacher, bookmarkFrequency), so a stream silent for longer lost its
    # peer; the stand-in sends none, so its streams stay silent as a dead one would.
    caplog.set_level(logging.INFO, logger="gpunode.services.kube")
    seed(server, {"a": "1"})
    watch = NodeLabelWatch(api, NODE, poll_interval=30, watch_timeout=600, silence_limit=0.3,
                           min_watch_interval=0.1).start()
    try:
        deadline = time.monotonic() + 10
        while len(server.watches("nodes")) < 3:  # three silences in a row (0.3 s each, less at ease)
            assert time.monotonic() < deadline, server.watches("nodes")
            time.sleep(0.05)
        assert watch.watching
        reads = [r for r in server.requests if r.method == "GET" and r.path == f"/api/v1/nodes/{NODE}"]
        assert len(reads) == 1  # resumed from the version seen: no read, no polling
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        label(server, "a", "2")
        assert seen(watch, "a", "2") < 5.0  # by the watch: a poll would take 30 s
    finally:
        watch.stop()


def test_at_rest_a_watch_costs_two_requests_an_hour():
    # What bench/bench_fleet.py measures at 1,000 nodes: one request per timeoutSeconds.
    assert 3600 / NodeLabelWatch.__init__.__kwdefaults__["watch_timeout"] <= 2
