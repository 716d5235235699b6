"""The container device plugin's DaemonSet rolled on the real node (``kubectl rollout restart``,
the chart's surge: the new pod starts beside the old one, which is deleted once the new one is
Ready) while a runc pod holds a container GPU and a runc pod asking for ``nvidia.com/gpu`` is
created every half second: how many the kubelet refuses, and how long it had no healthy container
GPU to give.

What the kubelet does (k8s.io/kubernetes v1.35.4, pkg/kubelet/cm/devicemanager): the new pod's
plugin registers and becomes the resource's (``plugin/v1beta1/handler.go`` ``registerClient``),
the old connection left open; when the old pod stops, its connection's end disconnects the
client registered then, the new one (``runClient``), and marks every device Unhealthy
(``PluginDisconnected``); the new plugin registers again at once (sandbox_plugin.server). A pod
admitted in that moment fails with ``UnexpectedAdmissionError``: the scheduler counts what the
Node's ``status.allocatable`` last said. Pods asking for ``nvidia.com/gpu`` name no runtime class,
so no offer label holds them back (docs/operating.md, "Restarts and upgrades"): the figure says
what the moment costs. Running containers are the runtime's: the holder keeps its GPU.
"""

from __future__ import annotations

import json
import threading
import time

from support.kubecluster import wait_for
from support.nodekit import CONTAINER_GPU, IMAGE, restart_count
from support.nodekit import NAMESPACE as RELEASE_NAMESPACE
from support.nodeswitch import CONTAINER, CONTAINER_PLUGIN, PASSTHROUGH, relabel, settled

from gpunode.host.root import HostRoot
from gpunode.services.podresources import allocatable_of

NAMESPACE = "node-plugin-roll-tests"


def runc_pod(name: str, command: list[str], labels: dict[str, str] | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels or {}},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": IMAGE, "imagePullPolicy": "Never",
                                     "command": command, "resources": {"limits": {CONTAINER_GPU: 1}}}]}}


def plugin_pods(node) -> str:
    """The plugin pods' state and each one's last log lines, for a rollout that did not move."""
    said = [node.cluster.kubectl("get", "ds", "-n", RELEASE_NAMESPACE, "-o", "yaml", check=False).stdout[-3000:],
            node.cluster.kubectl("get", "pods", "-n", RELEASE_NAMESPACE, "-o", "wide", "--show-labels",
                                 check=False).stdout,
            "\n".join(line for line in node.cluster.log("kube-controller-manager").splitlines()
                      if "daemon" in line.lower())[-4000:],
            node.describe(CONTAINER_PLUGIN, RELEASE_NAMESPACE)[-4000:]]
    for pod in node.pods(CONTAINER_PLUGIN, RELEASE_NAMESPACE):
        said.append(f"--- {pod['metadata']['name']}:\n"
                    + node.logs(pod["metadata"]["name"], RELEASE_NAMESPACE, "device-plugin")[-3000:])
    return "\n".join(said)


def test_runc_gpu_pods_arriving_through_a_rolling_update_of_the_container_plugin(node, node_figures):
    node.cluster.namespace(NAMESPACE)
    root = node.cluster.host_root
    host = HostRoot.at(root, runtime_root=str(root))

    def listed() -> int:  # the container GPUs the kubelet can give now (PodResources)
        return len(allocatable_of(host, CONTAINER_GPU) or ())

    names: list[str] = []
    try:
        relabel(node, CONTAINER)
        settled(node, CONTAINER, [])
        old = node.wait_ready(CONTAINER_PLUGIN)[0]
        wait_for(lambda: listed() == 8, "the kubelet listing 8 container GPUs", 60, every=0.5)
        node.run(runc_pod("holder", ["sleep", "3600"]))
        holder = node.wait_phase("holder", NAMESPACE)
        done = threading.Event()
        gaps: list[tuple[float, float]] = []  # (from, to): the kubelet listing fewer than 8

        def arrive() -> None:
            while not done.is_set():
                names.append(f"roll-{len(names)}")
                node.run(runc_pod(names[-1], ["true"], {"arrival": "plugin-roll"}))
                time.sleep(0.5)

        def sample() -> None:
            since = None
            while not done.is_set():
                short = listed() < 8
                if short and since is None:
                    since = time.monotonic()
                elif not short and since is not None:
                    gaps.append((since, time.monotonic()))
                    since = None
                time.sleep(0.01)

        daemonset = old["metadata"]["ownerReferences"][0]["name"]
        threads = [threading.Thread(target=arrive, daemon=True), threading.Thread(target=sample, daemon=True)]
        for t in threads:
            t.start()
        try:
            time.sleep(2)
            node.cluster.kubectl("rollout", "restart", f"daemonset/{daemonset}", "-n", RELEASE_NAMESPACE)
            try:
                wait_for(lambda: old["metadata"]["uid"] not in
                         {p["metadata"]["uid"] for p in node.pods(CONTAINER_PLUGIN, RELEASE_NAMESPACE)},
                         "the old pod gone", 180, every=0.5)
            except AssertionError as e:
                raise AssertionError(f"{e}\n{plugin_pods(node)}") from None
            node.wait_ready(CONTAINER_PLUGIN)
            wait_for(lambda: listed() == 8, "the new plugin's devices listed", 60, every=0.05)
            time.sleep(3)
        finally:
            done.set()
            for t in threads:
                t.join(30)

        def ended():
            items = json.loads(node.cluster.kubectl("get", "pods", "-n", NAMESPACE, "-l", "arrival=plugin-roll",
                                                    "-o", "json").stdout)["items"]
            return items if len(items) == len(names) and all(
                p["status"].get("phase") in ("Succeeded", "Failed") for p in items) else None

        pods = wait_for(ended, "every arriving pod ran or was refused", 300, every=1)
        refused = [p["metadata"]["name"] for p in pods if p["status"].get("reason") == "UnexpectedAdmissionError"]
        longest = max((b - a for a, b in gaps), default=0.0)
        node_figures.append(
            f"container plugin rolling update (surge): {len(pods)} runc nvidia.com/gpu pods arriving, "
            f"{len(refused)} refused (UnexpectedAdmissionError); the kubelet had fewer than 8 container GPUs "
            f"{len(gaps)} time(s), at most {longest * 1000:.0f} ms")
        # The running container is the runtime's, never admitted again: it keeps its GPU.
        pod = node.pod("holder", NAMESPACE)
        assert pod["status"]["phase"] == "Running" and restart_count(pod) == 0
        assert pod["status"]["containerStatuses"][0]["containerID"] == \
            holder["status"]["containerStatuses"][0]["containerID"]
        assert len(pods) > len(refused)  # admitted again once the new plugin registered
        # The new plugin served all along: registered before the old one stopped, and again at
        # once when the old one's end dropped it (the rollout without surge left the kubelet with
        # no container GPU for 3.0-8.7 s, and 2-4 of 13-15 pods refused, here).
        [new] = node.pods(CONTAINER_PLUGIN, RELEASE_NAMESPACE)
        said = node.logs(new["metadata"]["name"], RELEASE_NAMESPACE, "device-plugin")
        assert "the kubelet closed our ListAndWatch stream" in said, said[-3000:]
    except BaseException:
        node.cluster.kubectl("delete", "pods", "-n", NAMESPACE, "--all", "--wait=false")
        relabel(node, PASSTHROUGH)
        raise
    node.cluster.kubectl("delete", "pods", "-n", NAMESPACE, "--all", "--wait=false")
    relabel(node, PASSTHROUGH)
    settled(node, PASSTHROUGH, [])
