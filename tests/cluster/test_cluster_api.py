"""Secrets, node labels, events, connecting, and the stand-in's API-server behaviour."""

from __future__ import annotations

import base64
import json
import logging

import pytest
from kubernetes.client import CoreV1Api, NodeV1Api, V1ObjectMeta, V1RuntimeClass
from kubernetes.client.exceptions import ApiException
from support.apiserver import FakeApiServer

from gpunode.errors import ConfigError, GpuNodeError
from gpunode.services.apiclient import connect
from katamgr.cluster import (
    ObjectRef,
    agent_namespace,
    node_workload_mode,
    read_pull_secret,
    record_event,
)

DOCKER_CONFIG = b'{"auths": {"nvcr.io": {"auth": "JG9hdXRodG9rZW46c2VjcmV0"}}}'




def node(name: str, labels: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}}}


def secret(name: str, namespace: str, type_: str, data: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "type": type_,
            "metadata": {"name": name, "namespace": namespace},
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}


def status_of(error: ApiException) -> dict:
    return json.loads(error.body)


# --- the stand-in answers like the API server ------------------------------


def test_duplicate_create_is_409_already_exists_and_missing_is_404(api):
    node_api = NodeV1Api(api)
    body = V1RuntimeClass(metadata=V1ObjectMeta(name="kata"), handler="kata")
    created = node_api.create_runtime_class(body)
    assert created.metadata.uid and created.metadata.resource_version

    with pytest.raises(ApiException) as dup:
        node_api.create_runtime_class(body)
    assert dup.value.status == 409
    assert status_of(dup.value) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": 'runtimeclasses.node.k8s.io "kata" already exists',
        "reason": "AlreadyExists", "code": 409,
        "details": {"name": "kata", "group": "node.k8s.io", "kind": "runtimeclasses"}}

    with pytest.raises(ApiException) as missing:
        node_api.read_runtime_class("nope")
    assert missing.value.status == 404
    assert status_of(missing.value)["reason"] == "NotFound"
    with pytest.raises(ApiException) as gone:
        node_api.delete_runtime_class("nope")
    assert gone.value.status == 404


def test_resource_versions_grow_per_write_and_stale_updates_conflict(server, api):
    node_api = NodeV1Api(api)
    first = node_api.create_runtime_class(
        V1RuntimeClass(metadata=V1ObjectMeta(name="kata"), handler="kata"))
    stale = first.metadata.resource_version
    first.metadata.labels = {"a": "1"}
    second = node_api.replace_runtime_class("kata", first)
    assert int(second.metadata.resource_version) > int(stale)

    first.metadata.resource_version = stale
    first.metadata.labels = {"a": "2"}
    with pytest.raises(ApiException) as conflict:
        node_api.replace_runtime_class("kata", first)
    assert conflict.value.status == 409
    assert "the object has been modified" in status_of(conflict.value)["message"]

    same = node_api.patch_runtime_class("kata", {"metadata": {"labels": {"a": "1"}}})
    assert same.metadata.resource_version == second.metadata.resource_version  # no-op


def test_handler_is_validated_and_immutable(api):
    node_api = NodeV1Api(api)
    with pytest.raises(ApiException) as invalid:
        node_api.create_runtime_class(
            V1RuntimeClass(metadata=V1ObjectMeta(name="kata"), handler="Kata_Bad"))
    assert invalid.value.status == 422
    node_api.create_runtime_class(V1RuntimeClass(metadata=V1ObjectMeta(name="kata"),
                                                 handler="kata"))
    with pytest.raises(ApiException) as immutable:
        node_api.patch_runtime_class("kata", {"handler": "other"})
    assert immutable.value.status == 422
    assert "field is immutable" in status_of(immutable.value)["message"]


def test_apply_conflicts_with_another_manager_unless_forced(api):
    node_api = NodeV1Api(api)
    body = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
            "metadata": {"name": "kata"}, "handler": "kata",
            "scheduling": {"nodeSelector": {"pool": "a"}}}
    node_api.patch_runtime_class("kata", body, field_manager="admin",
                                 _content_type="application/apply-patch+yaml")
    body["scheduling"]["nodeSelector"]["pool"] = "b"
    with pytest.raises(ApiException) as conflict:
        node_api.patch_runtime_class("kata", body, field_manager="us",
                                     _content_type="application/apply-patch+yaml")
    assert conflict.value.status == 409
    assert status_of(conflict.value)["reason"] == "Conflict"
    forced = node_api.patch_runtime_class("kata", body, field_manager="us", force=True,
                                          _content_type="application/apply-patch+yaml")
    assert forced.scheduling.node_selector == {"pool": "b"}
    with pytest.raises(ApiException) as no_manager:
        node_api.patch_runtime_class("kata", body,
                                     _content_type="application/apply-patch+yaml")
    assert no_manager.value.status == 400


def test_label_selector_filters_lists(server, api):
    for name, labels in (("a", {"tier": "gpu", "x": "1"}), ("b", {"tier": "cpu"}), ("c", {})):
        server.seed(node(name, labels))
    core = CoreV1Api(api)

    def names(selector):
        return [n.metadata.name for n in core.list_node(label_selector=selector).items]

    assert names("tier=gpu") == ["a"]
    assert names("tier!=gpu") == ["b", "c"]
    assert names("tier") == ["a", "b"]
    assert names("!tier") == ["c"]
    assert names("tier in (gpu,cpu),x") == ["a"]
    assert names("tier notin (gpu)") == ["b", "c"]


# --- pull secrets ------------------------------------------------------------


def test_pull_secret_is_read_and_decoded(server, api):
    server.seed(secret("ngc", "gpu-operator", "kubernetes.io/dockerconfigjson",
                       {".dockerconfigjson": DOCKER_CONFIG}))
    assert read_pull_secret(api, "gpu-operator", "ngc") == DOCKER_CONFIG
    [request] = server.requests
    assert request.path == "/api/v1/namespaces/gpu-operator/secrets/ngc"


def test_missing_pull_secret_names_namespace_and_name(api):
    with pytest.raises(ConfigError, match=r"pull secret gpu-operator/ngc does not exist"):
        read_pull_secret(api, "gpu-operator", "ngc")


def test_pull_secret_of_the_wrong_type_is_refused(server, api):
    server.seed(secret("ngc", "default", "Opaque", {"password": b"x"}))
    with pytest.raises(ConfigError, match=r"default/ngc has type 'Opaque'.*docker-registry"):
        read_pull_secret(api, "default", "ngc")


def test_agent_namespace_comes_from_env_then_service_account(tmp_path):
    (tmp_path / "namespace").write_text("gpu-operator\n")
    assert agent_namespace({"POD_NAMESPACE": "kata"}, tmp_path) == "kata"
    assert agent_namespace({}, tmp_path) == "gpu-operator"
    assert agent_namespace({}, tmp_path / "absent") == "default"


# --- nodes -------------------------------------------------------------------


@pytest.mark.parametrize("labels, mode", [
    ({}, "container"),
    ({"nvidia.com/gpu.workload.config": "vm-passthrough"}, "vm-passthrough"),
    ({"nvidia.com/gpu.workload.config": "vm-vgpu"}, "vm-vgpu"),
    ({"nvidia.com/gpu.workload.config": "container"}, "container"),
])
def test_workload_mode_is_read_from_the_node_label(server, api, labels, mode):
    server.seed(node("gpu-1", labels))
    assert node_workload_mode(api, "gpu-1") == mode


def test_unknown_workload_mode_names_the_value(server, api):
    server.seed(node("gpu-1", {"nvidia.com/gpu.workload.config": "vm-passthru"}))
    with pytest.raises(ConfigError, match=r"gpu-1 has label nvidia.com/gpu.workload.config="
                                          r"'vm-passthru'.*vm-passthrough"):
        node_workload_mode(api, "gpu-1")


def test_missing_node_is_named(api):
    with pytest.raises(GpuNodeError, match="node gpu-9 does not exist"):
        node_workload_mode(api, "gpu-9")


# --- events ------------------------------------------------------------------


def test_event_is_recorded_against_the_node(server, api):
    ref = ObjectRef(kind="Node", name="gpu-1", uid="1234")
    assert record_event(api, "default", ref, "GpusBound", "bound 2 GPUs to vfio-pci")
    [event] = [r.body for r in server.writes()]
    assert event["involvedObject"] == {"kind": "Node", "name": "gpu-1", "uid": "1234",
                                       "apiVersion": "v1"}
    assert event["reason"] == "GpusBound" and event["type"] == "Normal"
    assert event["metadata"]["name"].startswith("gpu-1.")
    assert event["source"]["component"] == "kata-sandbox-manager"


def test_event_failure_is_logged_not_raised(caplog):
    with FakeApiServer(token="t") as server:
        anonymous = server.client()
        anonymous.configuration.api_key = {}
        with caplog.at_level(logging.WARNING):
            assert not record_event(anonymous, "default", ObjectRef("Node", "gpu-1"),
                                    "GpusBound", "x", "Warning")
    assert "could not record event GpusBound on Node gpu-1: HTTP 401" in caplog.text


def test_an_event_the_api_server_was_down_for_is_written_once_it_is_back(caplog):
    """As client-go's recorder (tools/record/event.go, recordToSink): no answer from the
    server is retried, 10 s apart in production; a refusal (the 401 above) is not. Unlike
    client-go, the 403 "not yet ready to handle request" a restarted API server answers
    until its admission plugins have synced is retried too (seen on the real node's fault
    suite: the switch's Event was lost)."""
    import time

    from katamgr.cluster import EventRecorder

    with FakeApiServer() as server:
        recorder = EventRecorder(server.client(), "gpu-1", retry_seconds=0.2)
        server.stop()  # the API server down across the switch
        with caplog.at_level(logging.WARNING):
            assert not recorder.record("WorkloadSwitched", "workload switch vm-passthrough -> container")
        assert recorder.pending == 1 and "trying again every" in caplog.text
        time.sleep(0.5)
        assert recorder.pending == 1  # still down: kept
        happened = time.time()
        server.start(warming=2)  # back, with its objects, on the same address; not ready at first
        # Written within a few tries (0.2 s apart); the bound is for a loaded 2-core CI
        # machine, where one write was seen to take 7 s, and the loop ends at the write.
        deadline = time.monotonic() + 30
        while recorder.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        [event] = [server.get("events", n, "default") for n in server.names("events")]
        assert event["reason"] == "WorkloadSwitched" and "vm-passthrough -> container" in event["message"]
        # Stamped when it happened, not when it could be written.
        from datetime import datetime

        stamped = datetime.fromisoformat(event["lastTimestamp"].replace("Z", "+00:00")).timestamp()
        assert stamped <= happened


def test_a_call_to_an_api_server_that_never_answers_is_bounded(tmp_path, monkeypatch):
    """An API server that accepts the connection and never answers (one shutting down or
    starting up): the Event is kept for a retry once the call's timeout passes, instead of
    holding the recorder's thread for good (the client's own default is no timeout)."""
    import contextlib
    import socket
    import threading
    import time

    from gpunode.services import apiclient
    from katamgr.cluster import EventRecorder

    monkeypatch.setattr(apiclient, "REQUEST_TIMEOUT", (1.0, 1.0))
    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def hold() -> None:
        with contextlib.suppress(OSError):  # closed at the end of the test
            while True:
                held.append(silent.accept()[0])
    threading.Thread(target=hold, daemon=True).start()
    with FakeApiServer() as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        kubeconfig.write_text(kubeconfig.read_text().replace(
            api.url, f"http://127.0.0.1:{silent.getsockname()[1]}"))
    client = connect(environ={"KUBECONFIG": str(kubeconfig)}, service_account_dir=tmp_path)
    recorder = EventRecorder(client, "gpu-1", retry_seconds=3600)
    started = time.monotonic()
    assert not recorder.record("WorkloadSwitched", "workload switch vm-passthrough -> container")
    assert time.monotonic() - started < 20  # urllib3's own retries included
    assert recorder.pending == 1
    assert held  # it did connect: the answer was what never came
    silent.close()


# --- connecting --------------------------------------------------------------


def test_no_cluster_means_none_and_a_clear_log(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        assert connect(environ={"HOME": str(tmp_path)}, service_account_dir=tmp_path) is None
    assert "no cluster reachable: no KUBECONFIG" in caplog.text


def test_kubeconfig_from_env_reaches_the_server_with_its_token(tmp_path):
    with FakeApiServer(token="kube-token") as server:
        server.seed(node("gpu-1", {"nvidia.com/gpu.workload.config": "vm-passthrough"}))
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        api = connect(environ={"KUBECONFIG": str(kubeconfig), "HOME": str(tmp_path)},
                      service_account_dir=tmp_path / "none")
        assert api is not None
        assert node_workload_mode(api, "gpu-1") == "vm-passthrough"


def test_default_kubeconfig_in_home_is_used(tmp_path):
    with FakeApiServer() as server:
        (tmp_path / ".kube").mkdir()
        server.write_kubeconfig(tmp_path / ".kube" / "config")
        api = connect(environ={"HOME": str(tmp_path)}, service_account_dir=tmp_path / "none")
        assert api is not None and api.configuration.host == server.url


def test_a_simulated_node_uses_only_a_cluster_it_is_given(tmp_path, caplog):
    """katamgr on a simulated node (--host, a demo in an admin's shell) never falls back
    to ~/.kube/config; KUBECONFIG (or a pod's service account) names the cluster to use."""
    with FakeApiServer() as server:
        (tmp_path / ".kube").mkdir()
        server.write_kubeconfig(tmp_path / ".kube" / "config")
        with caplog.at_level(logging.INFO, logger="gpunode.services.apiclient"):
            assert connect(environ={"HOME": str(tmp_path)}, service_account_dir=tmp_path / "none",
                           home_kubeconfig=False) is None
        assert "a simulated node: not using" in caplog.text and "set KUBECONFIG" in caplog.text
        named = connect(environ={"HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / ".kube" / "config")},
                        service_account_dir=tmp_path / "none", home_kubeconfig=False)
        assert named is not None and named.configuration.host == server.url


def test_broken_kubeconfig_is_a_config_error(tmp_path):
    bad = tmp_path / "kubeconfig"
    bad.write_text("apiVersion: v1\nkind: Config\ncurrent-context: missing\n")
    with pytest.raises(ConfigError, match=r"kubeconfig .*kubeconfig is unusable"):
        connect(environ={"KUBECONFIG": str(bad)}, service_account_dir=tmp_path / "none")


@pytest.fixture
def service_account(tmp_path):
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text("sa-token")
    (sa / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    return sa


IN_CLUSTER = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def test_in_cluster_service_account_beats_the_home_kubeconfig(tmp_path, service_account):
    with FakeApiServer() as server:
        (tmp_path / ".kube").mkdir()
        server.write_kubeconfig(tmp_path / ".kube" / "config")
        api = connect(environ={**IN_CLUSTER, "HOME": str(tmp_path)},
                      service_account_dir=service_account)
    assert api is not None
    assert api.configuration.host == "https://10.96.0.1:443"
    assert api.configuration.ssl_ca_cert == str(service_account / "ca.crt")
    assert api.configuration.api_key["BearerToken"] == "bearer sa-token"


def test_explicit_kubeconfig_beats_the_service_account(tmp_path, service_account):
    with FakeApiServer() as server:
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        api = connect(environ={**IN_CLUSTER, "KUBECONFIG": str(kubeconfig)},
                      service_account_dir=service_account)
        assert api is not None and api.configuration.host == server.url


def test_kubeconfig_naming_no_file_is_ignored_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        api = connect(environ={"KUBECONFIG": str(tmp_path / "absent"), "HOME": str(tmp_path)},
                      service_account_dir=tmp_path)
    assert api is None
    assert "names no existing file" in caplog.text
