"""No identity of the chart can change the cluster's isolation, on the real API
server (Kubernetes 1.35.4): the chart's ServiceAccounts, RBAC, RuntimeClasses and node-binding
policies applied server-side, two Nodes A and B, and a Pod of the sandbox agent's
ServiceAccount on A (no kubelet runs: it stays Pending) whose bound token is what the agent's
containers would hold.

Where each API-server fact comes from (k8s.io/kubernetes v1.35.4 unless named):
- a token bound to a Pod carries the Pod's node when ServiceAccountTokenPodNodeInfo is on
  (pkg/registry/core/serviceaccount/storage/token.go, "if nodeName := pod.Spec.NodeName";
  the gate: pkg/features/kube_features.go, beta and on in 1.30, GA and locked on in 1.32),
  and the authenticator hands it to admission as the user's extra
  authentication.kubernetes.io/node-name (k8s.io/apiserver
  pkg/authentication/serviceaccount/util.go, NodeNameKey);
- a ValidatingAdmissionPolicy's refusal is 403 Forbidden carrying the first failed
  validation's message ("ValidatingAdmissionPolicy '<name>' with binding '<name>' denied
  request: ...", k8s.io/apiserver pkg/admission/plugin/policy/validating/dispatcher.go);
- a Pod of a ServiceAccount or Pod with automountServiceAccountToken false gets no
  kube-api-access projected token volume (plugin/pkg/admission/serviceaccount/admission.go,
  shouldAutomount);
- RBAC answers 403 to a verb no rule grants (the authorizer), before admission runs.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.chartkit import FULL, merged, render_release
from support.kubecluster import wait_for

from gpunode.host import cc

pytestmark = pytest.mark.integration

RELEASE = "ksm-ids"
FULLNAME = f"{RELEASE}-kata-sandbox-manager"  # ksm.fullname: the release, then the chart
NODE_A, NODE_B = "identity-node-a", "identity-node-b"
AGENT = f"{FULLNAME}-sandbox-agent"
POD = "sandbox-agent-on-a"
GPU = "kata-qemu-nvidia-gpu"
DRIVER = "passthrough.kata-sandbox-manager.io"
# ccManager (the agent labels its Node) and the DRA driver (it writes its node's
# ResourceSlice): every write the policies bind. The container plugin and the uninstall hook
# bring their identities too.
VALUES = merged(FULL, {"ccManager": {"enabled": True}, "dra": {"enabled": True},
                       "devicePlugin": {"enabled": True},
                       "uninstall": {"revertNodes": True}})
IDENTITY_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
POLICY_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


def node_binding(obj: dict[str, Any]) -> bool:
    return (obj["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == "node-binding"


@pytest.fixture(scope="module")
def release(kube):
    """The chart's identities (hooks' included), its RuntimeClasses and its node-binding
    policies. Nothing that runs pods: no kubelet would start them."""
    objects = render_release(VALUES, RELEASE)
    applied = [o for o in objects if o["kind"] in IDENTITY_KINDS or o["kind"] == "RuntimeClass"
               or (o["kind"] in POLICY_KINDS and node_binding(o))]
    kube.namespace(RELEASE)
    kube.apply(applied, namespace=RELEASE)
    kube.apply([{"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
                for name in (NODE_A, NODE_B)], manager="test")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": POD, "namespace": RELEASE},
           "spec": {"serviceAccountName": AGENT, "nodeName": NODE_A,
                    "containers": [{"name": "agent", "image": "registry.invalid/never-pulled:1"}]}}
    # The ServiceAccount admission plugin looks the account up in its informer's cache,
    # which has the account a moment after it was made.
    wait_for(lambda: kube.kubectl("apply", "--server-side", "--field-manager", "test", "-f", "-",
                                  input=yaml.safe_dump(pod), check=False).returncode == 0,
             f"Pod {POD} admitted")
    yield objects
    kube.kubectl("delete", "resourceslices", "-l", "test=identities", "--ignore-not-found", check=False)
    kube.kubectl("delete", "pod", POD, "-n", RELEASE, "--wait=false", check=False)
    kube.kubectl("delete", "node", NODE_A, NODE_B, "--wait=false", check=False)
    kube.delete(applied, namespace=RELEASE)
    kube.kubectl("delete", "namespace", RELEASE, "--wait=false", check=False)


def kubeconfig(kube, token: str, path: Path) -> Path:
    config = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": kube.server,
                                                    "certificate-authority": str(kube.ca)}}],
        "users": [{"name": "token", "user": {"token": token}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "token",
                                                     "namespace": RELEASE}}],
        "current-context": "local",
    }
    path.write_text(json.dumps(config))
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def bound(kube, release, tmp_path_factory) -> Path:
    """The sandbox agent's token as its pod on node A holds it: bound to the Pod."""
    token = kube.kubectl("create", "token", AGENT, "-n", RELEASE, "--bound-object-kind", "Pod",
                         "--bound-object-name", POD, "--duration", "3600s").stdout.strip()
    return kubeconfig(kube, token, tmp_path_factory.mktemp("bound") / "agent.kubeconfig")


@pytest.fixture(scope="module")
def unbound(kube, release, tmp_path_factory) -> Path:
    """The same ServiceAccount's token with no object bound: no node in it."""
    return kubeconfig(kube, kube.token(RELEASE, AGENT), tmp_path_factory.mktemp("unbound") / "agent.kubeconfig")


def as_(kube, config: Path, *args: str, input: str | None = None):
    return kube.kubectl(*args, kubeconfig=config, input=input, check=False)


def refused(result, *words: str) -> bool:
    text = result.stderr
    return result.returncode != 0 and "forbidden" in text.lower() and all(w in text for w in words)


def slice_of(name: str, node: str) -> str:
    return yaml.safe_dump({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": name, "labels": {"test": "identities"}},
        "spec": {"driver": DRIVER, "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                 "devices": [{"name": "gpu-0"}]},
    })


def test_the_bound_token_names_the_pods_node(kube, bound):
    """What the policies read: the API server's own view of the token (SelfSubjectReview)."""
    review = json.loads(as_(kube, bound, "auth", "whoami", "-o", "json").stdout)
    user = review["status"]["userInfo"]
    assert user["username"] == f"system:serviceaccount:{RELEASE}:{AGENT}"
    assert user["extra"]["authentication.kubernetes.io/node-name"] == [NODE_A]
    assert user["extra"]["authentication.kubernetes.io/pod-name"] == [POD]
    # And in the JWT itself (kubernetes.io.node), as any verifier of the token sees it.
    token = yaml.safe_load(bound.read_text())["users"][0]["user"]["token"]
    payload = token.split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    assert claims["kubernetes.io"]["node"]["name"] == NODE_A


def test_the_policies_type_check_without_warnings(kube, release):
    names = [o["metadata"]["name"] for o in release
             if o["kind"] == "ValidatingAdmissionPolicy" and node_binding(o)]
    assert sorted(names) == [f"{AGENT}-nodes", f"{AGENT}-resourceslices"]
    for name in names:
        def checked(name=name):
            status = kube.get("validatingadmissionpolicy", name).get("status", {})
            return status if "typeChecking" in status else None

        status = wait_for(checked, f"status.typeChecking of ValidatingAdmissionPolicy {name}")
        assert not status["typeChecking"].get("expressionWarnings"), status["typeChecking"]


def test_the_agent_labels_only_its_own_node_and_only_its_labels(kube, bound):
    # The policy is in force once the API server's policy informer has it: a refusal (of a
    # probe label, so that an attempt made before then leaves no label the test looks at).
    wait_for(lambda: refused(as_(kube, bound, "label", "node", NODE_B, "probe.example.com/race=1", "--overwrite")),
             "the node-binding policy in force")
    other = as_(kube, bound, "label", "node", NODE_B, f"{cc.MODE_STATE_LABEL}=on", "--overwrite")
    assert refused(other, f"may change only its own Node, not {NODE_B}"), other.stderr
    assert f"{cc.MODE_STATE_LABEL}" not in kube.get("node", NODE_B)["metadata"].get("labels", {})

    # Its own node's CC state labels: what katamgr's CC room writes (a merge patch).
    own = as_(kube, bound, "label", "node", NODE_A, f"{cc.MODE_STATE_LABEL}=on",
              f"{cc.READY_STATE_LABEL}=true", "--overwrite")
    assert own.returncode == 0, own.stderr
    patched = as_(kube, bound, "patch", "node", NODE_A, "--type=merge", "-p",
                  json.dumps({"metadata": {"labels": {cc.READY_STATE_LABEL: None}}}))
    assert patched.returncode == 0, patched.stderr
    labels = kube.get("node", NODE_A)["metadata"]["labels"]
    assert labels[cc.MODE_STATE_LABEL] == "on" and cc.READY_STATE_LABEL not in labels

    # The offer label of a class no longer in the release's config (an earlier one's agent set
    # it): the agent takes it off with the class's runtime (katamgr.pipeline.offers), and may
    # never set one of a class the release does not name.
    dropped, unknown = (f"runtimeclass.kata-sandbox-manager.io/{n}" for n in ("dropped-class", "unknown-class"))
    kube.kubectl("label", "node", NODE_A, f"{dropped}=true", "--overwrite")
    taken_off = as_(kube, bound, "label", "node", NODE_A, f"{dropped}-")
    assert taken_off.returncode == 0, taken_off.stderr
    assert refused(as_(kube, bound, "label", "node", NODE_A, f"{unknown}=true"), f"may not change the label(s) {unknown}")
    assert not {dropped, unknown} & set(kube.get("node", NODE_A)["metadata"]["labels"])

    # Anything else of its own Node: another label (the workload label would move the
    # node's GPUs), a taint, the unschedulable bit, an annotation.
    for args, words in (
        (("label", "node", NODE_A, "nvidia.com/gpu.workload.config=container", "--overwrite"),
         ("may not change the label(s) nvidia.com/gpu.workload.config",)),
        (("taint", "node", NODE_A, "example.com/evict=now:NoExecute"), ("never its spec",)),
        (("patch", "node", NODE_A, "--type=merge", "-p", json.dumps({"spec": {"unschedulable": True}})),
         ("never its spec",)),
        (("annotate", "node", NODE_A, "example.com/x=y"), ("never its spec",)),
    ):
        result = as_(kube, bound, *args)
        assert refused(result, *words), (args, result.stderr)
    node = kube.get("node", NODE_A)
    assert not [t for t in node["spec"].get("taints", []) if t["key"] == "example.com/evict"]
    assert not node["spec"].get("unschedulable")
    # Nor its status, nor making or removing a Node.
    status = as_(kube, bound, "patch", "node", NODE_A, "--subresource=status", "--type=merge",
                 "-p", json.dumps({"status": {"capacity": {"nvidia.com/GA102GL_A10": "8"}}}))
    assert status.returncode != 0 and "forbidden" in status.stderr.lower(), status.stderr


def test_the_agent_sets_only_its_own_conditions_on_its_own_node(kube, bound):
    # What the agent writes, as it writes it (katamgr.cluster.conditions: a strategic merge
    # patch of nodes/status, merged by condition type), with its pod's bound token.
    from kubernetes.config import new_client_from_config

    from gpunode.errors import GpuNodeError
    from katamgr.cluster.conditions import patch_node_conditions

    api = new_client_from_config(config_file=str(bound))

    def write(node: str, condition: dict) -> str:
        try:
            patch_node_conditions(api, node, [condition])
        except GpuNodeError as exc:
            return str(exc)
        return ""

    ours = {"type": "SandboxGPUsReady", "status": "True", "reason": "GPUsBound", "message": "1 device(s)",
            "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}
    wait_for(lambda: "may change only its own Node" in write(NODE_B, ours), "the node-binding policy in force")
    assert write(NODE_A, ours) == ""
    found = {c["type"]: c for c in kube.get("node", NODE_A)["status"]["conditions"]}
    assert found["SandboxGPUsReady"]["reason"] == "GPUsBound"
    assert not [c for c in kube.get("node", NODE_B).get("status", {}).get("conditions", [])
                if c["type"] == "SandboxGPUsReady"]
    # Another's condition (the kubelet's Ready) is not the agent's to write.
    refusal = write(NODE_A, {**ours, "type": "Ready", "status": "False", "reason": "Faked"})
    assert "only conditions of its own types" in refusal, refusal
    assert "Ready" not in {c["type"] for c in kube.get("node", NODE_A)["status"]["conditions"]}


def test_a_token_without_a_node_writes_no_node(kube, bound, unbound):
    wait_for(lambda: refused(as_(kube, bound, "label", "node", NODE_B, "x=y")), "the policy in force")
    result = as_(kube, unbound, "label", "node", NODE_A, f"{cc.MODE_STATE_LABEL}=off", "--overwrite")
    assert refused(result, "carries no node name", "not bound to a pod on a node"), result.stderr


def test_the_dra_driver_writes_only_its_own_nodes_slices(kube, bound, unbound):
    create = ["create", "-f", "-"]
    other = wait_for(lambda: (lambda r: r if refused(r) else None)(
        as_(kube, bound, *create, input=slice_of("identity-slice-b", NODE_B))), "the slice policy in force")
    assert refused(other, f"may write only its own node's ResourceSlices, not one of node {NODE_B}"), other.stderr
    own = as_(kube, bound, *create, input=slice_of("identity-slice-a", NODE_A))
    assert own.returncode == 0, own.stderr
    # A slice of no node (allNodes) is not its node's either.
    cluster_wide = yaml.safe_load(slice_of("identity-slice-all", NODE_A))
    del cluster_wide["spec"]["nodeName"]
    cluster_wide["spec"]["allNodes"] = True
    result = as_(kube, bound, *create, input=yaml.safe_dump(cluster_wide))
    assert refused(result, "not a slice of no node"), result.stderr
    # Delete is judged by the slice deleted (oldObject): B's, made by the admin, stays.
    kube.kubectl(*create, input=slice_of("identity-slice-b", NODE_B))
    result = as_(kube, bound, "delete", "resourceslice", "identity-slice-b")
    assert refused(result, f"not one of node {NODE_B}"), result.stderr
    result = as_(kube, unbound, *create, input=slice_of("identity-slice-a2", NODE_A))
    assert refused(result, "carries no node name"), result.stderr
    deleted = as_(kube, bound, "delete", "resourceslice", "identity-slice-a")
    assert deleted.returncode == 0, deleted.stderr


def test_no_identity_of_the_chart_may_touch_a_runtime_class(kube, release, bound, tmp_path):
    """Each ServiceAccount the chart makes, with a token the API server issues for it (its
    pods' automount setting aside): deleting kata-qemu-nvidia-gpu and making a class with
    handler runc are refused by RBAC, so no node or webhook can repoint Kata pods at runc."""
    accounts = sorted(o["metadata"]["name"] for o in release if o["kind"] == "ServiceAccount")
    assert accounts == sorted(f"{FULLNAME}-{w}" for w in (
        "sandbox-agent", "device-plugin", "webhook", "revert", "revert-wait"))
    runc = yaml.safe_dump({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                           "metadata": {"name": "identity-runc"}, "handler": "runc"})
    configs = {account: kubeconfig(kube, kube.token(RELEASE, account), tmp_path / f"{account}.kubeconfig")
               for account in accounts}
    configs["sandbox-agent, bound to its pod"] = bound
    for who, config in configs.items():
        for args, text in ((("delete", "runtimeclass", GPU), None), (("create", "-f", "-"), runc),
                           (("patch", "runtimeclass", GPU, "--type=merge", "-p",
                             json.dumps({"scheduling": {"nodeSelector": {"kubernetes.io/hostname": NODE_A}}})),
                            None)):
            result = as_(kube, config, *args, input=text)
            assert result.returncode != 0 and "(Forbidden)" in result.stderr, (who, args, result.stderr)
    kept = kube.get("runtimeclass", GPU)
    assert kept["handler"] == GPU
    assert kept["scheduling"]["nodeSelector"] == {"nvidia.com/gpu.workload.config": "vm-passthrough",
                                                  f"runtimeclass.kata-sandbox-manager.io/{GPU}": "true"}
    assert kube.kubectl("get", "runtimeclass", "identity-runc", check=False).returncode != 0


def test_only_the_workloads_that_call_the_api_get_a_token(kube, release):
    """The pods as the API server admits them: each of these has a projected token volume: the
    sandbox agent's, the revert hook's (GPU labels on), and the container plugin's, which follows
    its own Node's labels (``--workload auto --auto-modes container``: it serves a split node's
    container share and stands down on a vm-passthrough node without one). With sandbox workloads
    off it runs ``--workload container`` without a token (tests/chart/test_rbac.py)."""
    templates = {o["metadata"]["name"]: o["spec"]["template"] for o in release
                 if o["kind"] == "DaemonSet"}
    # The revert hook takes the agent's GPU labels off its Node (gpuLabels.enabled, the default).
    pods = {f"{FULLNAME}-device-plugin": True, f"{FULLNAME}-revert": True}
    for workload, gets_token in pods.items():
        template = templates[workload]
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{workload}-probe", "namespace": RELEASE},
               "spec": {**template["spec"], "nodeName": NODE_B}}
        created = kube.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-",
                               input=yaml.safe_dump(pod))
        volumes = [v["name"] for v in json.loads(created.stdout)["spec"].get("volumes", [])]
        assert any(v.startswith("kube-api-access") for v in volumes) == gets_token, (workload, volumes)
    agent = kube.get("pod", POD, "-n", RELEASE)
    assert any(v["name"].startswith("kube-api-access") for v in agent["spec"]["volumes"])
