"""``katamgr webhook`` over real TLS on loopback: AdmissionReview v1 in, AdmissionReview v1
out; the returned JSONPatch applied with ``jsonpatch`` and the result checked against the
Kubernetes API schema (kubernetes-validate)."""

from __future__ import annotations

import base64
import copy
import json
import os
import socket
import ssl
import time

import jsonpatch
import pytest
from support import podkit
from support.podkit import A10, KATA, container, pod, review
from support.tlskit import make_ca, write_server_pair

from katamgr.admission.review import MAX_BODY
from katamgr.admission.rules import Policy
from katamgr.cli import build_parser

KUBE_VERSION = "1.33.0"


def patched(obj: dict, answer: dict) -> dict:
    response = answer["response"]
    if "patch" not in response:
        return obj
    assert response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    return jsonpatch.JsonPatch(ops).apply(copy.deepcopy(obj))


def valid(obj: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def env_of(obj: dict) -> list[list[dict]]:
    spec = obj["spec"]
    return [c.get("env") for c in (spec.get("initContainers") or []) + spec["containers"]]


def assert_contract(sent: dict, answer: dict) -> dict:
    assert answer["apiVersion"] == "admission.k8s.io/v1"
    assert answer["kind"] == "AdmissionReview"
    assert answer["response"]["uid"] == sent["request"]["uid"]
    return answer["response"]


@pytest.mark.parametrize("case", ["no-request", "request-0", "cpu-only", "init-containers", "deployment"])
def test_mutate_voids_every_container_of_a_pod_without_a_gpu(webhook, case):
    _, client = webhook
    obj = podkit.cases()[case]
    sent = review(obj)
    answer = client.review("/mutate", sent)
    response = assert_contract(sent, answer)
    assert response["allowed"] is True
    result = patched(obj, answer)
    for env in env_of(result):
        assert [e for e in env if e["name"] == "NVIDIA_VISIBLE_DEVICES"] == [
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    # Nothing else changes.
    stripped = copy.deepcopy(result)
    for c in (stripped["spec"].get("initContainers") or []) + stripped["spec"]["containers"]:
        c.pop("env")
    assert stripped == obj
    valid(result)


def test_init_containers_are_voided_too(webhook):
    _, client = webhook
    obj = podkit.cases()["init-containers"]
    result = patched(obj, client.review("/mutate", review(obj)))
    assert len(env_of(result)) == 3 and all(env_of(result))


def test_a_user_value_is_replaced_and_the_rest_of_env_kept(webhook):
    _, client = webhook
    obj = podkit.cases()["user-all"]
    result = patched(obj, client.review("/mutate", review(obj)))
    (env,) = env_of(result)
    assert env == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}, {"name": "OTHER", "value": "x"}]
    valid(result)


def test_duplicates_and_value_from_are_replaced_by_one_void():
    from katamgr.admission.rules import mutate

    obj = pod(container())
    obj["spec"]["containers"][0]["env"] = [
        {"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "A", "value": "1"},
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
    ]
    result = jsonpatch.JsonPatch(mutate(obj, Policy())).apply(copy.deepcopy(obj))
    assert result["spec"]["containers"][0]["env"] == [
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}, {"name": "A", "value": "1"}]


def test_an_already_void_pod_gets_no_patch(webhook):
    _, client = webhook
    obj = pod(container(env={"NVIDIA_VISIBLE_DEVICES": "void"}))
    response = client.review("/mutate", review(obj))["response"]
    assert response == {"uid": response["uid"], "allowed": True}


@pytest.mark.parametrize("case", ["gpu", "mig", "passthrough-kata", "passthrough-none"])
def test_mutate_leaves_a_pod_whose_every_container_asks_for_a_gpu_untouched(webhook, case):
    _, client = webhook
    obj = podkit.cases()[case]
    response = client.review("/mutate", review(obj))["response"]
    assert response["allowed"] is True
    assert "patch" not in response and "patchType" not in response


@pytest.mark.parametrize("case", ["passthrough-kata", "passthrough-snp", "gpu", "no-request", "deployment"])
def test_validate_allows(webhook, case):
    _, client = webhook
    sent = review(podkit.cases()[case])
    response = assert_contract(sent, client.review("/validate", sent))
    assert response == {"uid": sent["request"]["uid"], "allowed": True}


@pytest.mark.parametrize("case, where, has", [
    ("passthrough-none", 'container "app"', "sets no runtimeClassName"),
    ("passthrough-runc", 'container "app"', 'runtimeClassName is "runc"'),
    ("passthrough-init", 'init container "loader"', "sets no runtimeClassName"),
])
def test_validate_denies_passthrough_outside_kata_naming_container_resource_and_fix(webhook, case, where, has):
    _, client = webhook
    sent = review(podkit.cases()[case])
    response = assert_contract(sent, client.review("/validate", sent))
    assert response["allowed"] is False
    status = response["status"]
    assert status["code"] == 403 and status["reason"] == "Forbidden"
    message = status["message"]
    assert where in message and has in message
    assert (A10 in message) or ("nvidia.com/pgpu" in message)
    assert ("set spec.runtimeClassName to a Kata GPU class (its handler kata-qemu-nvidia-gpu*, or one of "
            "kata-qemu-nvidia-gpu, kata-qemu-nvidia-gpu-snp, ") in message


def test_a_deployment_pod_is_named_by_its_generate_name(webhook):
    _, client = webhook
    obj = podkit.deployment_pod(container(limits={A10: "1"}))
    assert "name" not in obj["metadata"]
    response = client.review("/validate", review(obj))["response"]
    assert response["allowed"] is False
    assert 'pod "web-5d9c7b7f9-*"' in response["status"]["message"]


def test_runtime_classes_and_passthrough_patterns_are_configurable(start_webhook):
    _, client = start_webhook(Policy(runtime_classes=("my-kata",), passthrough=("example.com/*",)))
    assert client.review("/validate", review(pod(container(limits={A10: "1"}))))["response"]["allowed"]
    denied = client.review("/validate", review(pod(container(limits={"example.com/fpga": "1"}))))
    assert "set spec.runtimeClassName to a Kata GPU class (its handler kata-qemu-nvidia-gpu*, or one of my-kata)" \
        in denied["response"]["status"]["message"]
    allowed = client.review("/validate", review(pod(container(limits={"example.com/fpga": "1"}),
                                                    runtime_class="my-kata")))
    assert allowed["response"]["allowed"]


def test_inject_runtime_class_sets_the_class_when_absent(start_webhook):
    _, client = start_webhook(Policy(inject_runtime_class=True))
    obj = podkit.cases()["passthrough-none"]
    answer = client.review("/mutate", review(obj))
    result = patched(obj, answer)
    assert result["spec"]["runtimeClassName"] == KATA
    assert {**result["spec"], "runtimeClassName": None} == {**obj["spec"], "runtimeClassName": None}
    valid(result)
    # The mutated pod then passes /validate; an explicit other class is left for /validate to deny.
    assert client.review("/validate", review(result))["response"]["allowed"]
    runc = podkit.cases()["passthrough-runc"]
    assert "patch" not in client.review("/mutate", review(runc))["response"]
    assert not client.review("/validate", review(runc))["response"]["allowed"]
    # A pod without a GPU is still voided, not given a class.
    plain = podkit.cases()["no-request"]
    assert "runtimeClassName" not in (patched(plain, client.review("/mutate", review(plain)))["spec"])


def test_malformed_json_is_a_400_with_a_message(webhook):
    _, client = webhook
    status, body = client.request("POST", "/mutate", b"{not json")
    assert status == 400 and "not JSON" in json.loads(body)["error"]
    status, body = client.request("POST", "/validate", json.dumps({"apiVersion": "v1", "kind": "Pod"}).encode())
    assert status == 400 and "admission.k8s.io/v1" in json.loads(body)["error"]
    status, body = client.request("POST", "/validate", json.dumps(
        {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}).encode())
    assert status == 400 and "uid" in json.loads(body)["error"]
    status, body = client.request("POST", "/mutate", b"[1, 2]")
    assert status == 400
    # The server is still there.
    assert client.request("GET", "/healthz") == (200, b"ok\n")


def test_an_oversized_body_is_refused_without_reading_it(webhook):
    _, client = webhook
    status, body = client.request("POST", "/mutate", b" " * (MAX_BODY + 1))
    assert status == 413 and "limit" in json.loads(body)["error"]
    assert client.request("GET", "/healthz")[0] == 200


def test_a_huge_content_length_is_answered_before_any_body_is_sent(webhook, ca):
    server, _ = webhook
    context = ca.client_context()
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="localhost") as tls:
        tls.sendall(b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 1000000000\r\n\r\n")
        answer = b""
        while chunk := tls.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413")
    assert b"over the 3145728-byte limit" in answer


def test_a_non_pod_is_denied_with_a_status(webhook):
    _, client = webhook
    config_map = podkit.serialise(podkit.k8s.V1ConfigMap(api_version="v1", kind="ConfigMap",
                                                         metadata=podkit.k8s.V1ObjectMeta(name="web")))
    sent = review(config_map, kind={"group": "", "version": "v1", "kind": "ConfigMap"})
    for path in ("/mutate", "/validate"):
        response = assert_contract(sent, client.review(path, sent))
        assert response["allowed"] is False
        assert response["status"]["code"] == 400
        assert "v1 ConfigMap" in response["status"]["message"]


def test_delete_is_allowed_untouched(webhook):
    _, client = webhook
    sent = review(podkit.cases()["passthrough-none"], operation="DELETE")
    sent["request"]["object"] = None
    assert client.review("/validate", sent)["response"]["allowed"] is True


def test_unknown_paths_and_healthz(webhook):
    _, client = webhook
    assert client.request("GET", "/healthz") == (200, b"ok\n")
    assert client.request("GET", "/nope")[0] == 404
    assert client.request("POST", "/nope", b"{}")[0] == 404


def test_a_client_that_does_not_speak_tls_does_not_stop_the_server(webhook):
    server, client = webhook
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=5) as raw:
        raw.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        raw.recv(100)
    assert client.request("GET", "/healthz")[0] == 200


def test_the_certificate_is_reloaded_when_the_files_change(webhook, tls_files, ca):
    server, client = webhook
    first = client.peer_cert()
    client.close()
    cert, key = tls_files
    # A renewal signed by a new CA (say cert-manager re-issued the CA): old trust fails, new works.
    new_ca = make_ca("renewed-ca")
    write_server_pair(new_ca, cert, key)
    future = time.time() + 5
    os.utime(cert, (future, future))
    with pytest.raises(ssl.SSLCertVerificationError):
        client.request("GET", "/healthz")
    client.close()
    from support.tlskit import Client

    renewed = Client(server.server_address[1], new_ca)
    try:
        assert renewed.request("GET", "/healthz")[0] == 200
        assert renewed.peer_cert() != first
    finally:
        renewed.close()
    assert server.certs.loads == 2


def test_a_half_written_pair_keeps_the_previous_certificate(webhook, tls_files):
    server, client = webhook
    cert, _ = tls_files
    cert.write_text("-----BEGIN CERTIFICATE-----\ngarbage\n")
    client.close()
    assert client.request("GET", "/healthz")[0] == 200
    assert server.certs.loads == 1


def test_the_cli_parses_the_webhook_flags():
    args = build_parser().parse_args([
        "webhook", "--tls-cert-file", "c", "--tls-private-key-file", "k",
        "--runtime-class", "a", "--runtime-class", "b", "--inject-runtime-class"])
    assert args.listen == "0.0.0.0:8443"
    assert args.runtime_class == ["a", "b"] and args.inject_runtime_class


def test_the_cli_says_what_is_wrong_with_the_tls_files(tmp_path, capsys):
    from katamgr.cli import main

    code = main(["webhook", "--listen", "127.0.0.1:0", "--tls-cert-file", str(tmp_path / "none.crt"),
                 "--tls-private-key-file", str(tmp_path / "none.key")])
    assert code == 2
    assert "TLS" in capsys.readouterr().err
