"""Isolation on the real node: the chart's own webhook Deployment (its 3 replicas, started by
the kubelet from our image) judges each container on its own, and the real kubelet runs an
ephemeral container (``kubectl debug``) with ``NVIDIA_VISIBLE_DEVICES=void``. With every
webhook replica gone, the cluster's own namespaces still create pods and tenants' do not.

Facts from upstream: kubectl debug adds an ephemeral container by a PATCH of
pods/ephemeralcontainers (staging/src/k8s.io/kubectl/pkg/cmd/debug/debug.go); the kubelet
starts it in the running pod (pkg/kubelet/kuberuntime/kuberuntime_manager.go,
computePodActions: ephemeral containers to start).
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request

import pytest
import yaml
from support.kubecluster import wait_for
from support.nodekit import IMAGE, NAMESPACE, RELEASE, WEBHOOK_REPLICAS

TENANT = "node-isolation-tests"
VISIBLE = "NVIDIA_VISIBLE_DEVICES"


def container(name: str, gpu: bool = False, command: str = "env; sleep 3600") -> dict:
    c = {"name": name, "image": IMAGE, "imagePullPolicy": "Never", "command": ["sh", "-c", command]}
    if gpu:
        c["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    return c


def manifest(name: str, containers: list[dict], init: list[dict] | None = None) -> dict:
    spec = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "containers": containers}
    if init:
        spec["initContainers"] = init
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


@pytest.fixture(scope="module")
def tenant(node):
    node.wait_chart_ready()
    node.cluster.namespace(TENANT)
    yield TENANT
    node.cluster.kubectl("delete", "namespace", TENANT, "--wait=false", check=False)


def create(node, obj: dict, namespace: str):
    return node.cluster.kubectl("create", "-n", namespace, "-f", "-", "-o", "json",
                                input=yaml.safe_dump(obj), check=False)


def stored_visible(pod: dict) -> dict[str, str | None]:
    spec = pod["spec"]
    every = spec.get("initContainers", []) + spec["containers"] + spec.get("ephemeralContainers", [])
    return {c["name"]: next((e.get("value") for e in c.get("env", []) if e["name"] == VISIBLE), None)
            for c in every}


def test_each_container_that_asked_for_no_gpu_is_stored_with_void(node, tenant):
    """A runc pod whose app asks for a GPU and whose sidecar does not, and a pod whose init
    container alone asks: the chart's webhook voids exactly the containers that asked for
    none (the pods stay Pending: this node offers passthrough GPUs, not nvidia.com/gpu)."""
    cases = {
        "gpu-and-sidecar": (manifest("gpu-and-sidecar", [container("app", gpu=True), container("sidecar")]),
                            {"app": None, "sidecar": "void"}),
        "init-only": (manifest("init-only", [container("app")], init=[container("warmup", gpu=True, command="true")]),
                      {"warmup": None, "app": "void"}),
    }
    for name, (obj, want) in cases.items():
        result = create(node, obj, tenant)
        assert result.returncode == 0, (name, result.stderr)
        assert stored_visible(json.loads(result.stdout)) == want, name
        node.cluster.kubectl("delete", "pod", name, "-n", tenant, "--wait=false", check=False)


def test_kubectl_debug_runs_its_container_with_void(node, tenant):
    node.run({**manifest("target", [container("app", command="sleep 3600")]),
              "metadata": {"name": "target", "namespace": tenant}})
    node.wait_phase("target", tenant)
    debug = node.cluster.kubectl(
        "debug", "-n", tenant, "target", f"--image={IMAGE}", "--image-pull-policy=Never",
        "--container=debugger", f"--env={VISIBLE}=all", "--", "sh", "-c", "env; sleep 3600", check=False)
    assert debug.returncode == 0, debug.stderr
    stored = node.pod("target", tenant)
    assert stored_visible(stored)["debugger"] == "void"
    # The kubelet ran it with that env: the container's own word.
    log = wait_for(lambda: (text := node.logs("target", tenant, container="debugger")) and "PATH=" in text
                   and text, "the debugger's env", 60, every=0.5)
    assert f"{VISIBLE}=void" in log.splitlines(), log
    node.delete_pod("target", tenant)


def test_with_every_webhook_replica_gone_the_infrastructure_namespaces_still_create_pods(node, tenant):
    deployment = f"{RELEASE}-webhook"
    for namespace in ("gpu-operator",):
        node.cluster.namespace(namespace)
    node.cluster.kubectl("scale", "deployment", deployment, "-n", NAMESPACE, "--replicas=0")
    try:
        wait_for(lambda: not node.pods("app.kubernetes.io/component=webhook"), "every webhook replica gone",
                 120, every=1)

        def refused():
            result = create(node, manifest("tenant-pod", [container("app")]), tenant)
            if result.returncode == 0:
                node.cluster.kubectl("delete", "pod", "tenant-pod", "-n", tenant, "--wait=false", check=False)
                return None
            return result.stderr

        refusal = wait_for(refused, "a tenant pod refused with no webhook replica", 60, every=1)
        assert "failed calling webhook" in refusal, refusal
        for namespace in ("kube-system", NAMESPACE):
            result = create(node, manifest("infra-pod", [container("app", command="true")]), namespace)
            assert result.returncode == 0, (namespace, result.stderr)
            node.cluster.kubectl("delete", "pod", "infra-pod", "-n", namespace, "--wait=false", check=False)
        # A namespace is not left out for its name: local-node.yaml lists no gpu-operator.
        by_name = create(node, manifest("infra-pod", [container("app", command="true")]), "gpu-operator")
        assert by_name.returncode != 0 and "failed calling webhook" in by_name.stderr, by_name.stderr
    finally:
        node.cluster.kubectl("scale", "deployment", deployment, "-n", NAMESPACE,
                             f"--replicas={WEBHOOK_REPLICAS}")
        node.wait_chart_ready()


def _token_of(node, component: str, container: str) -> str:
    """The token the kubelet projected into a chart pod (bound to that pod on this node)."""
    pod = node.wait_ready(f"app.kubernetes.io/component={component}",
                          count=WEBHOOK_REPLICAS if component == "webhook" else 1)[0]
    return node.cluster.kubectl("exec", "-n", NAMESPACE, pod["metadata"]["name"], "-c", container, "--",
                                "cat", "/var/run/secrets/kubernetes.io/serviceaccount/token").stdout.strip()


def _as(node, token: str, *args: str):
    return node.cluster.kubectl("--kubeconfig=/dev/null", f"--server={node.cluster.server}",
                                f"--certificate-authority={node.cluster.ca}", f"--token={token}", *args,
                                check=False)


def test_the_tokens_the_kubelet_gives_the_chart_pods_cannot_change_isolation(node, tenant):
    """The real projected tokens of the agent's and the webhook's pods: neither may
    delete the Kata RuntimeClass or make one with handler runc, and the agent's may not change
    its Node's workload label (the node-binding policy)."""
    tokens = {"sandbox-agent": _token_of(node, "sandbox-agent", "kata-manager"),
              "webhook": _token_of(node, "webhook", "webhook")}
    for who, token in tokens.items():
        assert _as(node, token, "auth", "whoami").returncode == 0, who
        deleted = _as(node, token, "delete", "runtimeclass", "kata-qemu-nvidia-gpu", "--dry-run=server")
        assert deleted.returncode != 0 and "forbidden" in deleted.stderr.lower(), (who, deleted.stderr)
        forged = node.cluster.kubectl(
            "--kubeconfig=/dev/null", f"--server={node.cluster.server}",
            f"--certificate-authority={node.cluster.ca}", f"--token={token}", "create", "-f", "-",
            "--dry-run=server", input=yaml.safe_dump({
                "apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                "metadata": {"name": "forged-kata"}, "handler": "runc"}), check=False)
        assert forged.returncode != 0 and "forbidden" in forged.stderr.lower(), (who, forged.stderr)
    # The agent may label its own Node (its GPU labels), but no other label of it (the
    # workload label would move the node's GPUs): the node-binding policy refuses it, on the
    # token the kubelet bound to the agent's pod on this node. The webhook may patch no Node.
    code, message = _patch_node(node, tokens["sandbox-agent"], "local-node")
    assert code == 403 and "may not change the label(s) example.com/probe" in message, message
    assert _patch_node(node, tokens["webhook"], "local-node")[0] == 403


def _patch_node(node, token: str, name: str) -> tuple[int, str]:
    context = ssl.create_default_context(cafile=str(node.cluster.ca))
    request = urllib.request.Request(
        f"{node.cluster.server}/api/v1/nodes/{name}", method="PATCH",
        data=json.dumps({"metadata": {"labels": {"example.com/probe": "1"}}}).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/merge-patch+json"})
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as answer:
            return answer.status, ""
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
