"""Partial success on the real node: one runtime class whose artifacts cannot be
had, beside a good one, with the real API server, scheduler, kubelet and containerd.

The chart is applied from our image with examples/values/local-node.yaml plus a second
class, ``kata-qemu-nvidia-gpu-tdx``, whose artifacts name a registry nobody listens on (the
discard port on the agent pod's own loopback: refused at once, as the README's
examples/values/mixed-cluster.yaml names a placeholder mirror for that class). What a user
sees: the GPUs advertised, a Kata pod of the good class running; the failed class's offer
label absent from the Node, so a pod asking for it stays Pending with the scheduler's
reason instead of landing on a node whose containerd lacks its runtime; the
RuntimeClassFailed Event, the metric and /readyz naming it; the agent pod NotReady. Then
the class is made good (``helm upgrade`` with its artifacts fixed): the label returns (a
RuntimeClassOffered Event), the metric, /readyz and the pod's readiness recover, and the
waiting pod runs. Last, the class dropped from the values (as the package fixture had them):
the agent stops offering it (RuntimeClassNotOffered).

Facts from Kubernetes: the RuntimeClass admission plugin copies a class's
scheduling.nodeSelector into every pod naming it (plugin/pkg/admission/runtimeclass), and
the scheduler's NodeAffinity plugin reports a node whose labels miss it as "node(s) didn't
match Pod's node affinity/selector" (pkg/scheduler/framework/plugins/nodeaffinity,
ErrReasonPod); the kubelet marks a container not ready while its readiness probe fails
(HTTP status >= 400, pkg/probe/http) and records a "Readiness probe failed" Event on the pod
(pkg/kubelet/prober/prober.go). A changed kataManager config rolls the agent's DaemonSet
(its checksum/config annotation).

The agent's retry backoff is katamgr's own (2 s doubling, reconciler.RETRY_INITIAL; no chart
value sets it): the test never waits for a retry, as the fix rolls the pod.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest
import yaml
from support.kubecluster import wait_for
from support.nodekit import (
    AGENT,
    GPU_RESOURCE,
    IMAGE,
    KATA_CLASS,
    NODE,
    NODE_VALUES,
    POD_TIMEOUT,
    is_ready,
    metric,
    restart_count,
)
from support.nodekit import NAMESPACE as RELEASE_NAMESPACE

from gpunode.kataclasses import GPU_TDX, offer_label

NAMESPACE = "node-partial-tests"
AGENT_PORT = 9410  # the chart's metrics.agentPort
# Nobody listens on the discard port of the agent pod's own loopback: connection refused at
# once, on every machine (a placeholder name may resolve, or time out, by the host's DNS).
UNREACHABLE = "127.0.0.1:9/mirror/kata-gpu-artifacts:ubuntu22.04-535.86.10-tdx"
# hack/local-cluster puts an OCI layout with both classes' artifacts into the node's host.
# A class no other test of the suite installs: katamgr keeps a class's installed artifacts
# when its registry cannot be reached (katamgr.artifacts.install), so a class test_node_cc
# installed earlier would not fail here. The fix takes the layout's -snp artifacts (no Kata
# guest runs here: any kernel and initrd do).
LAYOUT = "oci-layout:///opt/kata-artifacts/layout:kata-qemu-nvidia-gpu-snp"
# The rolls here: the new agent pod scheduled, started on this 2-core machine, reconciled.
ROLL_TIMEOUT = 240
# The kubelet's readiness probe of the agent (the chart: every 10 s).
PROBE_TIMEOUT = 60
# An agent's first reconcile here: 8 GPUs bound by the emulated kernel, the artifacts checked.
RECONCILE_TIMEOUT = 180


def values_with_tdx(url: str) -> dict:
    values = yaml.safe_load(NODE_VALUES.read_text())
    # Not confidential here, so the offer label alone stands between its pods and the node
    # (the CC-ready selector a confidential class adds is test_node_cc's); the node's containerd
    # has a runtime handler of this name (hack/localnode.py).
    values["kataManager"]["config"]["runtimeClasses"].append(
        {"name": GPU_TDX, "nodeSelector": {}, "confidential": False, "artifacts": {"url": url}})
    return values


def labels(node) -> dict[str, str]:
    return node.get()["metadata"].get("labels", {})


def agent_daemonset(node) -> dict[str, Any]:
    out = node.cluster.kubectl("get", "daemonsets", "-n", RELEASE_NAMESPACE, "-l", AGENT, "-o", "json").stdout
    (daemonset,) = json.loads(out)["items"]
    return daemonset


def rolled_agent(node) -> dict[str, Any] | None:
    """The agent's one pod, once it is the DaemonSet's current template (the config's
    checksum) and its kata-manager container runs; None before."""
    want = agent_daemonset(node)["spec"]["template"]["metadata"].get("annotations", {}).get("checksum/config")
    pods = [p for p in node.pods(AGENT) if not p["metadata"].get("deletionTimestamp")]
    if len(pods) != 1 or (pods[0]["metadata"].get("annotations") or {}).get("checksum/config") != want:
        return None
    running = {c["name"]: "running" in c.get("state", {}) for c in pods[0]["status"].get("containerStatuses", [])}
    return pods[0] if running.get("kata-manager") else None


def switch_chart(node, values: dict, tmp_path_factory) -> dict[str, Any]:
    """`helm upgrade` with ``values``: the agent's pod rolled to them and running (not
    waited Ready: the partial state keeps it NotReady by design)."""
    path = tmp_path_factory.mktemp("partial-values") / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    node.cluster_chart("up", "--values", str(path))
    try:
        return wait_for(lambda: rolled_agent(node), "the agent's pod rolled to the new values and running",
                        ROLL_TIMEOUT, every=1)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{node.describe(AGENT)}") from None


def agent_ready(node) -> dict[str, Any]:
    """The agent's pod Ready after a roll (its first reconcile done), or what its /readyz and
    log said: the suite's wait_chart_ready allows a pod start, not a reconcile on this machine."""
    try:
        return node.wait_ready(AGENT, timeout=RECONCILE_TIMEOUT)[0]
    except AssertionError as e:
        pods = [p for p in node.pods(AGENT) if p["status"].get("podIP")]
        said = [f"{said_ready(p)}\n" + node.logs(p["metadata"]["name"], RELEASE_NAMESPACE,
                                                          "kata-manager")[-4000:] for p in pods]
        raise AssertionError(f"{e}\n" + "\n".join(said)) from None


def said_ready(pod: dict[str, Any]) -> object:
    try:
        return probe(pod, "/readyz")
    except OSError as e:
        return e


def probe(pod: dict[str, Any], path: str) -> tuple[int, str]:
    """A GET of the agent's ``path`` through the pod's address, as the kubelet probes it."""
    url = f"http://{pod['status']['podIP']}:{AGENT_PORT}{path}"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - a pod on this node
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def class_ready(node, pod: dict[str, Any]) -> dict[str, float | None]:
    text = node.scrape(pod, AGENT_PORT)
    return {name: metric(text, "katamgr_runtime_class_ready", runtime_class=name) for name in (KATA_CLASS, GPU_TDX)}


def gpu_pod(name: str, runtime_class: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"runtimeClassName": runtime_class, "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": IMAGE, "imagePullPolicy": "Never",
                                     "command": ["sleep", "3600"],
                                     "resources": {"limits": {GPU_RESOURCE: "1"}}}]}}


def gpu_deployment(name: str, runtime_class: str) -> dict[str, Any]:
    pod = gpu_pod(name, runtime_class)
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": pod["metadata"],
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}}, "spec": pod["spec"]}}}


def unschedulable(node, selector: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """A pod of ``selector`` and its PodScheduled condition, once the scheduler gave up on it."""
    for pod in node.pods(selector, NAMESPACE):
        conditions = {c["type"]: c for c in pod.get("status", {}).get("conditions", [])}
        scheduled = conditions.get("PodScheduled")
        if scheduled and scheduled["status"] == "False":
            return pod, scheduled
    return None


def running(node, selector: str) -> dict[str, Any] | None:
    return next((p for p in node.pods(selector, NAMESPACE) if p["status"].get("phase") == "Running"), None)


def seen(node, reason: str) -> dict[str, int]:
    """The Node's Events of ``reason`` so far (uid -> count): earlier tests' stay an hour."""
    return {e["metadata"]["uid"]: e.get("count", 1) for e in node.events(reason)}


def new_events(node, reason: str, before: dict[str, int], text: str) -> list[dict[str, Any]]:
    """Events of ``reason`` on the Node naming ``text``, written (or repeated) since ``before``."""
    return [e for e in node.events(reason) if text in e["message"]
            and e.get("count", 1) > before.get(e["metadata"]["uid"], 0)]


def pod_events(node, pod: dict[str, Any], reason: str) -> list[dict[str, Any]]:
    selector = f"involvedObject.uid={pod['metadata']['uid']},reason={reason}"
    out = node.cluster.kubectl("get", "events", "-n", pod["metadata"]["namespace"], "--field-selector",
                               selector, "-o", "json").stdout
    return json.loads(out)["items"]


@pytest.fixture(scope="module")
def broken(node, tmp_path_factory):
    """The chart with the -tdx class's artifacts unreachable; afterwards the chart, the
    RuntimeClasses and the Node's labels as the package fixture left them."""
    node.cluster.namespace(NAMESPACE)
    before = seen(node, "RuntimeClassFailed")
    agent = switch_chart(node, values_with_tdx(UNREACHABLE), tmp_path_factory)
    try:
        yield agent, before
    finally:
        node.cluster.kubectl("delete", "deployment", "waiting", "-n", NAMESPACE, "--ignore-not-found",
                             "--wait=true", timeout=120, check=False)
        node.delete_pod("good", NAMESPACE)
        # Idempotent where the last test already went back: then nothing rolls.
        node.cluster_chart("up")
        # hack/local-chart applies and never prunes; helm upgrade deletes the class it no
        # longer renders (Helm owns the RuntimeClasses).
        node.cluster.kubectl("delete", "runtimeclass", GPU_TDX, "--ignore-not-found", check=False)
        wait_for(lambda: rolled_agent(node), "the agent's pod back on the node's values", ROLL_TIMEOUT, every=1)
        agent_ready(node)
        node.wait_chart_ready()
        node.label(offer_label(GPU_TDX), None)  # where the last test failed before the agent took it off
        node.wait_resource(GPU_RESOURCE, 8, timeout=120)


def test_a_class_whose_artifacts_cannot_be_had_is_not_offered_and_comes_back_once_fixed(
        node, broken, tmp_path_factory):
    agent, failed_before = broken
    # The agent's first reconcile over (the GPUs bound, four tries at the registry): its
    # /readyz names the class.
    status, why = wait_for(lambda: (r := probe(agent, "/readyz")) and "no reconcile" not in r[1] and r,
                           "the agent's first reconcile finished", RECONCILE_TIMEOUT, every=1)
    assert status == 503 and f"runtime class(es) {GPU_TDX} failed and are not offered on this node" in why, why
    assert "127.0.0.1:9" in why and "connection refused" in why, why
    # The agent's pod stays NotReady by design: the kubelet's probe of /readyz fails (and
    # the device plugin beside it is ready).
    failing = wait_for(lambda: pod_events(node, agent, "Unhealthy"), "the agent's readiness probe failed",
                       PROBE_TIMEOUT, every=1)
    assert any("Readiness probe failed" in e["message"] and "503" in e["message"] for e in failing), failing
    agent = node.pod(agent["metadata"]["name"], RELEASE_NAMESPACE)
    assert not is_ready(agent)
    ready = {c["name"]: c["ready"] for c in agent["status"]["containerStatuses"]}
    assert ready == {"kata-manager": False, "sandbox-device-plugin": True}, ready
    assert class_ready(node, agent) == {KATA_CLASS: 1, GPU_TDX: 0}

    # The GPUs are bound and advertised all the same; the good class is offered, the failed one not.
    node.wait_resource(GPU_RESOURCE, 8)
    # Offered once the kubelet lists the plugin's devices as allocatable (agent.offergate).
    offered = wait_for(lambda: {k: v for k, v in labels(node).items() if k.startswith("runtimeclass.")} or None,
                       "the good class offered", 30, every=0.5)
    assert offered == {offer_label(KATA_CLASS): "true"}, offered
    event = wait_for(lambda: new_events(node, "RuntimeClassFailed", failed_before, GPU_TDX),
                     "a RuntimeClassFailed Event naming the class", 30, every=1)[-1]
    assert event["type"] == "Warning" and "127.0.0.1:9" in event["message"], event
    assert f"RuntimeClass {GPU_TDX} is not offered on this node" in event["message"], event

    # A pod of the good class runs; one of the failed class waits with the scheduler's reason.
    node.run(gpu_pod("good", KATA_CLASS))
    good = node.wait_phase("good", NAMESPACE)
    # (A Deployment, as such pods are run: its pod may be placed while the agent's rolled pod
    # re-registers the device plugin, and the kubelet then fails that pod at admission,
    # "UnexpectedAdmissionError ... no healthy devices"; the ReplicaSet makes another.)
    node.run(gpu_deployment("waiting", GPU_TDX))
    waiting, reason = wait_for(lambda: unschedulable(node, "app=waiting"), "the failed class's pod unschedulable",
                               60, every=1)
    assert waiting["spec"]["nodeSelector"][offer_label(GPU_TDX)] == "true"  # RuntimeClass admission's copy
    assert reason["reason"] == "Unschedulable" and "node affinity/selector" in reason["message"], reason
    assert not node.pod(waiting["metadata"]["name"], NAMESPACE)["spec"].get("nodeName")

    # The class made good (its artifacts where the node can have them): helm upgrade.
    offered_before = seen(node, "RuntimeClassOffered")
    switch_chart(node, values_with_tdx(LAYOUT), tmp_path_factory)
    agent = agent_ready(node)
    assert class_ready(node, agent) == {KATA_CLASS: 1, GPU_TDX: 1}
    status, why = probe(agent, "/readyz")
    assert status == 200 and why.startswith("ok: the last reconcile succeeded"), why
    assert f"Kata artifacts verified ({KATA_CLASS}, {GPU_TDX})" in why, why  # the upgrade gate passed
    # Offered once the kubelet lists the new pod's plugin's devices (agent.offergate: every check).
    wait_for(lambda: labels(node).get(offer_label(GPU_TDX)) == "true", "the class offered again", 30, every=0.5)
    offered = wait_for(lambda: new_events(node, "RuntimeClassOffered", offered_before, GPU_TDX),
                       "a RuntimeClassOffered Event naming the class", 30, every=1)
    assert offered[-1]["type"] == "Normal", offered
    try:
        ran = wait_for(lambda: running(node, "app=waiting"), "a pod of the failed class's Deployment running",
                       POD_TIMEOUT, every=1)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{node.describe('app=waiting', NAMESPACE)}") from None
    assert ran["spec"]["nodeName"] == NODE
    # The good class's pod went on through both rolls of the agent.
    still = node.pod("good", NAMESPACE)
    assert still["status"]["phase"] == "Running" and restart_count(still) == 0
    assert still["metadata"]["uid"] == good["metadata"]["uid"]


def test_a_class_dropped_from_the_values_is_no_longer_offered(node, broken):
    node.cluster.kubectl("delete", "deployment", "waiting", "-n", NAMESPACE, "--wait=true", timeout=120)
    node.delete_pod("good", NAMESPACE)
    # Back to the node's own values, which name no -tdx class; Helm deletes its RuntimeClass.
    withdrawn_before = seen(node, "RuntimeClassNotOffered")
    node.cluster_chart("up")
    node.cluster.kubectl("delete", "runtimeclass", GPU_TDX, "--ignore-not-found")
    wait_for(lambda: rolled_agent(node), "the agent's pod rolled back to the node's values", ROLL_TIMEOUT, every=1)
    agent = agent_ready(node)
    # Its runtime is gone from containerd's config here: no label may still offer it.
    # Offered once the kubelet lists the plugin's devices as allocatable (agent.offergate).
    offered = wait_for(lambda: {k: v for k, v in labels(node).items() if k.startswith("runtimeclass.")} or None,
                       "the good class offered", 30, every=0.5)
    assert offered == {offer_label(KATA_CLASS): "true"}, offered
    assert class_ready(node, agent) == {KATA_CLASS: 1, GPU_TDX: None}
    wait_for(lambda: new_events(node, "RuntimeClassNotOffered", withdrawn_before, GPU_TDX),
             "a RuntimeClassNotOffered Event naming the class", 30, every=1)
