"""The sandbox agent's pod as the real kubelet runs it: probes, metrics, a kubelet restart,
the pod deleted and recreated by its DaemonSet, and Kata pods arriving all through that.

Facts from the kubelet: probes are HTTP GETs to the pod's IP and the container's named port
(pkg/kubelet/prober/prober.go); a restarted kubelet deletes and recreates
/var/lib/kubelet/device-plugins/kubelet.sock and every plugin must register again
(pkg/kubelet/cm/devicemanager/plugin/v1beta1/server.go, Start removes the dir's sockets),
while running containers are kept (the runtime owns them).
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from support.kubecluster import wait_for
from support.nodekit import GPU_RESOURCE, IMAGE, KATA_CLASS, metric, restart_count

from gpunode.kataclasses import offer_label

NAMESPACE = "node-agent-tests"
AGENT = "app.kubernetes.io/component=sandbox-agent"


@pytest.fixture(scope="module")
def kata_pod(node):
    """A Kata pod holding one GPU through everything below."""
    node.cluster.namespace(NAMESPACE)
    node.wait_resource(GPU_RESOURCE, 8)
    node.run({"apiVersion": "v1", "kind": "Pod",
              "metadata": {"name": "holder", "namespace": NAMESPACE},
              "spec": {"runtimeClassName": KATA_CLASS, "terminationGracePeriodSeconds": 1,
                       "containers": [{"name": "main", "image": IMAGE, "imagePullPolicy": "Never",
                                       "command": ["sleep", "3600"],
                                       "resources": {"limits": {GPU_RESOURCE: 1}}}]}})
    pod = node.wait_phase("holder", NAMESPACE)
    yield pod
    node.delete_pod("holder", NAMESPACE)


def container_id(pod) -> str:
    return pod["status"]["containerStatuses"][0]["containerID"]


def test_ready_by_its_probes_and_scraped_through_the_pod_ip(node):
    pod = node.wait_ready(AGENT)[0]
    ready = {c["name"]: c["ready"] for c in pod["status"]["containerStatuses"]}
    assert ready == {"kata-manager": True, "sandbox-device-plugin": True}
    agent = node.scrape(pod, 9410)
    assert metric(agent, "katamgr_reconciles_total", result="success") >= 1
    assert metric(agent, "katamgr_devices", kind="gpu", driver="vfio-pci") == 8
    plugin = node.scrape(pod, 9411)
    assert metric(plugin, "sandbox_device_plugin_kubelet_registrations_total", resource=GPU_RESOURCE) >= 1


def test_a_kubelet_restart_keeps_the_pod_and_the_plugins_register_again(node, kata_pod):
    agent = node.component_pod("sandbox-agent")
    before = metric(node.scrape(agent, 9411), "sandbox_device_plugin_kubelet_registrations_total",
                    resource=GPU_RESOURCE)
    node.cluster.component("restart", "kubelet")
    wait_for(lambda: metric(node.scrape(agent, 9411), "sandbox_device_plugin_kubelet_registrations_total",
                            resource=GPU_RESOURCE) == before + 1,
             "the plugin registered again with the restarted kubelet", 60, every=0.5)
    node.wait_resource(GPU_RESOURCE, 8)
    pod = node.pod("holder", NAMESPACE)
    assert container_id(pod) == container_id(kata_pod) and restart_count(pod) == 0
    again = node.component_pod("sandbox-agent")
    assert again["metadata"]["uid"] == agent["metadata"]["uid"] and restart_count(again) == 0


def test_the_agent_pod_deleted_and_recreated_moves_no_gpu(node, kata_pod):
    old = node.component_pod("sandbox-agent")
    node.delete_pod(old["metadata"]["name"], old["metadata"]["namespace"])
    new = node.wait_ready(AGENT)[0]
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    wait_for(lambda: metric(node.scrape(new, 9410), "katamgr_reconciles_total", result="success"),
             "the new agent's first successful reconcile", 60, every=0.5)
    log = node.logs(new["metadata"]["name"], new["metadata"]["namespace"], "kata-manager")
    assert "reconciling: start" in log and "bound 0000" not in log, log
    node.wait_resource(GPU_RESOURCE, 8)
    pod = node.pod("holder", NAMESPACE)
    assert container_id(pod) == container_id(kata_pod) and restart_count(pod) == 0


def short_kata_pod(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE,
                                                            "labels": {"arrival": "roll"}},
            "spec": {"runtimeClassName": KATA_CLASS, "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": IMAGE, "imagePullPolicy": "Never",
                                     "command": ["true"], "resources": {"limits": {GPU_RESOURCE: 1}}}]}}


def test_kata_pods_arriving_through_a_rolling_update_of_the_agent_are_none_refused(node, kata_pod, node_figures):
    """The agent's pod deleted as a rolling update deletes it (SIGTERM, the pod's 30 s grace), a
    Kata pod asking for a GPU created every half second throughout. The agent takes the offer
    label off before its plugin's stream ends (agent.offergate), so the scheduler holds the pods
    that come meanwhile and the kubelet refuses none (k8s.io/kubernetes v1.35.4
    pkg/kubelet/cm/devicemanager/manager.go: a pod admitted while the plugin is gone fails with
    UnexpectedAdmissionError); the label is back once the new plugin's devices are allocatable."""
    node.wait_resource(GPU_RESOURCE, 8)
    old = node.component_pod("sandbox-agent")
    # The agent asks the kubelet at every check (10 s): the class is offered once it lists the devices.
    def offered() -> bool:
        return node.get()["metadata"]["labels"].get(offer_label(KATA_CLASS)) == "true"

    try:
        wait_for(offered, "the class offered on the node", 60, every=0.5)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{node.logs(old['metadata']['name'], old['metadata']['namespace'], 'kata-manager')[-4000:]}") from None
    names: list[str] = []
    done = threading.Event()

    def arrive() -> None:
        while not done.is_set():
            names.append(f"roll-{len(names)}")
            node.run(short_kata_pod(names[-1]))
            time.sleep(0.5)

    arrivals = threading.Thread(target=arrive, daemon=True)
    arrivals.start()
    try:
        time.sleep(2)
        started = time.monotonic()
        node.cluster.kubectl("delete", "pod", old["metadata"]["name"], "-n", old["metadata"]["namespace"],
                             "--wait=false")
        new = node.wait_ready(AGENT)[0]
        assert new["metadata"]["uid"] != old["metadata"]["uid"]
        wait_for(offered, "the class offered again once the new plugin's devices are allocatable", 90, every=0.5)
        offered_again = time.monotonic() - started
        time.sleep(3)
    finally:
        done.set()
        arrivals.join(30)

    def settled():
        items = json.loads(node.cluster.kubectl("get", "pods", "-n", NAMESPACE, "-l", "arrival=roll",
                                                "-o", "json").stdout)["items"]
        return items if len(items) == len(names) and all(
            p["status"].get("phase") in ("Succeeded", "Failed") for p in items) else None

    pods = wait_for(settled, "every arriving pod ran or was refused", 180, every=1)
    refused = [(p["metadata"]["name"], p["status"].get("reason"), p["status"].get("message"))
               for p in pods if p["status"].get("phase") == "Failed"]
    node_figures.append(f"agent rolling update: {len(pods)} Kata GPU pods arriving, {len(refused)} refused "
                        f"(UnexpectedAdmissionError); class offered again {offered_again:.1f} s after the delete")
    assert refused == [], refused
    pod = node.pod("holder", NAMESPACE)
    assert container_id(pod) == container_id(kata_pod) and restart_count(pod) == 0
    node.cluster.kubectl("delete", "pods", "-n", NAMESPACE, "-l", "arrival=roll", "--wait=false")
