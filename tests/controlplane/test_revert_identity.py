"""The uninstall revert's identity on the real API server: the hook's ServiceAccount, RBAC and
its own node-binding policy (templates/uninstall-revert-policy.yaml) applied server-side, two
Nodes A and B, and a Pod of the revert's ServiceAccount on A (no kubelet: it stays Pending)
whose bound token is what katamgr revert holds. RBAC lets it patch every Node; the policy
lets it only take the agent's labels off its own (tests/controlplane/test_identities.py
says where each API-server fact comes from)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support.chartkit import FULL, render_release
from support.kubecluster import wait_for

from gpunode.kataclasses import offer_label
from gpunode.policy import gpulabels

pytestmark = pytest.mark.integration

RELEASE = "ksm-revert"
FULLNAME = f"{RELEASE}-kata-sandbox-manager"
REVERT = f"{FULLNAME}-revert"
NODE_A, NODE_B = "revert-node-a", "revert-node-b"
POD = "revert-on-a"
PRODUCT = gpulabels.KEYS[0]
OFFER = offer_label("kata-qemu-nvidia-gpu")


@pytest.fixture(scope="module")
def hook(kube):
    objects = render_release(FULL, RELEASE)
    applied = [o for o in objects if (o["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == "revert"
               and o["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                                 "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")]
    assert {o["kind"] for o in applied} >= {"ValidatingAdmissionPolicy", "ClusterRoleBinding"}
    kube.namespace(RELEASE)
    kube.apply(applied, namespace=RELEASE)
    labels = {PRODUCT: "NVIDIA-A10", OFFER: "true", "nvidia.com/gpu.workload.config": "vm-passthrough"}
    kube.apply([{"apiVersion": "v1", "kind": "Node", "metadata": {"name": n, "labels": labels}}
                for n in (NODE_A, NODE_B)], manager="test")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": POD, "namespace": RELEASE},
           "spec": {"serviceAccountName": REVERT, "nodeName": NODE_A,
                    "containers": [{"name": "revert", "image": "registry.invalid/never-pulled:1"}]}}
    wait_for(lambda: kube.kubectl("apply", "--server-side", "--field-manager", "test", "-f", "-",
                                  input=yaml.safe_dump(pod), check=False).returncode == 0, f"Pod {POD} admitted")
    yield applied
    kube.kubectl("delete", "pod", POD, "-n", RELEASE, "--wait=false", check=False)
    kube.kubectl("delete", "node", NODE_A, NODE_B, "--wait=false", check=False)
    kube.delete(applied, namespace=RELEASE)
    kube.kubectl("delete", "namespace", RELEASE, "--wait=false", check=False)


def kubeconfig(kube, token: str, path: Path) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": kube.server, "certificate-authority": str(kube.ca)}}],
        "users": [{"name": "token", "user": {"token": token}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "token"}}],
        "current-context": "local"}))
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def bound(kube, hook, tmp_path_factory) -> Path:
    token = kube.kubectl("create", "token", REVERT, "-n", RELEASE, "--bound-object-kind", "Pod",
                         "--bound-object-name", POD, "--duration", "3600s").stdout.strip()
    return kubeconfig(kube, token, tmp_path_factory.mktemp("revert") / "bound.kubeconfig")


def as_(kube, config: Path, *args: str):
    return kube.kubectl(*args, kubeconfig=config, check=False)


def refused(result, *words: str) -> bool:
    return result.returncode != 0 and "forbidden" in result.stderr.lower() and all(w in result.stderr for w in words)


def test_the_policy_type_checks_without_warnings(kube, hook):
    def checked():
        status = kube.get("validatingadmissionpolicy", f"{REVERT}-nodes").get("status", {})
        return status if "typeChecking" in status else None

    status = wait_for(checked, "status.typeChecking of the revert's policy")
    assert not status["typeChecking"].get("expressionWarnings"), status["typeChecking"]


def policy_in_force(kube, bound) -> bool:
    """Whether the API server refuses the revert identity another Node's label yet (it loads a
    new policy asynchronously); a probe that got through is undone, as the admin."""
    if refused(as_(kube, bound, "label", "node", NODE_B, f"{PRODUCT}-")):
        return True
    kube.kubectl("label", "node", NODE_B, f"{PRODUCT}=NVIDIA-A10", "--overwrite")
    return False


def test_the_revert_takes_only_the_agents_labels_off_only_its_own_node(kube, bound):
    wait_for(lambda: policy_in_force(kube, bound), "the revert's policy in force")
    other = as_(kube, bound, "label", "node", NODE_B, f"{OFFER}-")
    assert refused(other, f"may change only its own Node, not {NODE_B}"), other.stderr
    assert {PRODUCT, OFFER} <= set(kube.get("node", NODE_B)["metadata"]["labels"])
    # What katamgr revert sends: a merge patch of nulls, on its own Node.
    own = as_(kube, bound, "patch", "node", NODE_A, "--type=merge", "-p",
              json.dumps({"metadata": {"labels": {PRODUCT: None, OFFER: None}}}))
    assert own.returncode == 0, own.stderr
    assert not {PRODUCT, OFFER} & set(kube.get("node", NODE_A)["metadata"]["labels"])
    # It never sets a label, not even one the agent owns, and takes off no other.
    for args, words in (
        (("label", "node", NODE_A, f"{PRODUCT}=NVIDIA-H100"), ("only takes labels off", PRODUCT)),
        (("label", "node", NODE_A, "nvidia.com/gpu.workload.config-"), ("may not take off",)),
        (("taint", "node", NODE_A, "example.com/evict=now:NoExecute"), ("never its spec",)),
    ):
        result = as_(kube, bound, *args)
        assert refused(result, *words), (args, result.stderr)
    assert kube.get("node", NODE_A)["metadata"]["labels"]["nvidia.com/gpu.workload.config"] == "vm-passthrough"


def test_a_revert_token_without_a_node_writes_no_node(kube, bound, tmp_path):
    wait_for(lambda: policy_in_force(kube, bound), "the revert's policy in force")
    unbound = kubeconfig(kube, kube.token(RELEASE, REVERT), tmp_path / "unbound.kubeconfig")
    result = as_(kube, unbound, "label", "node", NODE_B, f"{OFFER}-")
    assert refused(result, "carries no node name"), result.stderr
