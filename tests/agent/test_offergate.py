"""The offer gate (katamgr.agent.offergate) through a rolling update of the agent's pod, while
Kata pods asking for our GPUs keep arriving: no pod ends in UnexpectedAdmissionError.

The parts: a simulated a10-server, the real sandbox device plugin (PluginManager) serving the
kubelet simulator over the device plugin gRPC, the agent offering its classes on a Node of the
API stand-in, and a scheduler that places a pod here only while the class's offer label is
true (the API server's RuntimeClass admission copies the class's nodeSelector into the pod:
Kubernetes plugin/pkg/admission/runtimeclass). The kubelet simulator admits as the device
manager does (k8s.io/kubernetes v1.35.4 pkg/kubelet/cm/devicemanager/manager.go): a plugin
whose stream ended has every device Unhealthy (``PluginDisconnected``), so a pod admitted
then is refused. A pod reaches the kubelet a moment after it is bound (its API watch).

Without the gate (the plugin stops at once, the labels stay) the same arrivals are refused:
the test can fail.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time

import pytest
from support.agentkit import make_agent
from support.apiserver import FakeApiServer
from support.kataconfig import kata_manager_yaml, prepare_node
from support.passthroughkit import A10, FAST, NAMING, bind

from gpunode.host import standdown
from gpunode.kataclasses import GPU, offer_label
from katamgr.cluster import EventRecorder
from katamgr.commands.setup import node_labels
from katamgr.config import parse_config
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.reconcile import Steps
from nodesim.kubelet import KubeletSimulator
from nodesim.kubeletstate import AdmissionError
from nodesim.materialise import materialise
from nodesim.node import open_node
from nodesim.profiles import find_profile
from sandbox_plugin.manager import Mode, PluginManager

NODE = "gpu-node-1"
BIND_TO_KUBELET = 0.3  # a bound pod reaches the kubelet's pod manager this much later (its watch)


@pytest.fixture
def node():
    root = tempfile.mkdtemp(prefix="og-")  # a socket path must fit in 107 bytes
    materialise(find_profile("a10-server"), root)
    host = prepare_node(open_node(root).host)
    bind(host)
    kubelet = KubeletSimulator(host)
    kubelet.start()
    api = FakeApiServer().__enter__()
    api.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    plugins: list[PluginManager] = []
    yield host, kubelet, api, plugins
    for plugin in plugins:
        plugin.stop()
    kubelet.stop()
    api.__exit__(None, None, None)
    shutil.rmtree(root, ignore_errors=True)


def agent_for(host, api, *, gate: bool = True):
    ctx = KataContext(parse_config(kata_manager_yaml((GPU,))), manage_runtime_classes=False)
    agent = make_agent(host, NAMING, Steps(cdi=False), ctx, offer_labels=node_labels(api.client(), NODE),
                       events=EventRecorder(api.client(), NODE), offer_gate=gate)
    if agent.reconciler.gate is not None:
        agent.reconciler.gate.settle = 1.0
    return agent


def offered(api) -> bool:
    return (api.get("nodes", NODE)["metadata"].get("labels") or {}).get(offer_label(GPU)) == "true"


def start_plugin(host, kubelet, plugins) -> PluginManager:
    plugin = PluginManager(host, Mode.VM_PASSTHROUGH, naming=NAMING, backoff=FAST)
    plugins.append(plugin)
    plugin.start()
    kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4)
    return plugin


class Arrivals:
    """Kata pods asking for one A10 each, one every 50 ms: scheduled here only while the class
    is offered, admitted by the kubelet BIND_TO_KUBELET later, done a moment after admission."""

    def __init__(self, api, kubelet) -> None:
        self.api, self.kubelet = api, kubelet
        self.stop = threading.Event()
        self.admitted: list[str] = []
        self.rejected: list[str] = []
        self.threads: list[threading.Thread] = []
        self.count = 0

    def run(self) -> None:
        while not self.stop.is_set():
            if offered(self.api):
                self.count += 1
                name = f"kata-{self.count}"
                t = threading.Thread(target=self._kubelet, args=(name,), daemon=True)
                t.start()
                self.threads.append(t)
            time.sleep(0.05)

    def _kubelet(self, name: str) -> None:
        time.sleep(BIND_TO_KUBELET)
        try:
            self.kubelet.admit_pod("tenant", name, {"main": {A10: 1}})
        except AdmissionError as exc:
            self.rejected.append(f"{name}: {exc}")
            return
        self.admitted.append(name)
        time.sleep(0.1)
        self.kubelet.remove_pod("tenant", name)

    def __enter__(self):
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(5)
        for t in self.threads:
            t.join(5)


def roll(host, kubelet, old_agent, old_plugin, plugins, *, gate: bool) -> None:
    """The agent's pod deleted: SIGTERM to both containers at once, the new pod a second later."""
    signalled = time.time()
    stopped = threading.Thread(target=old_agent.stand_down)
    stopped.start()
    if gate:
        assert standdown.wait_withdrawn(host, signalled, 15.0)  # the plugin's --stop-grace
    old_plugin.stop()
    stopped.join(15)
    time.sleep(1.0)  # the new pod's containers start
    start_plugin(host, kubelet, plugins)


def test_the_class_is_offered_only_once_the_kubelet_can_give_the_plugins_devices(node):
    host, kubelet, api, plugins = node
    agent = agent_for(host, api)
    assert agent.reconcile("start").ok
    # Installed and registered with containerd, but no plugin has registered with the kubelet yet.
    assert not offered(api)
    assert "lists none of this node's passthrough devices" in agent.reconciler.gate.why
    start_plugin(host, kubelet, plugins)
    agent.follow_offers()
    assert offered(api)
    events = [api.get("events", n, "default") for n in api.names("events")]
    assert any(e["reason"] == "RuntimeClassOffered" and "the kubelet can give 4" in e["message"] for e in events)
    plugins.pop().stop()  # the plugin ends (a restart): the kubelet marks its devices Unhealthy
    kubelet.wait_for(lambda s: not s.healthy(A10))
    agent.follow_offers()
    assert not offered(api)


def test_a_rolling_update_with_kata_pods_arriving_rejects_none_and_keeps_the_running_pods_gpus(node):
    host, kubelet, api, plugins = node
    old_plugin = start_plugin(host, kubelet, plugins)
    agent = agent_for(host, api)
    assert agent.reconcile("start").ok and offered(api)
    kubelet.admit_pod("tenant", "running", {"main": {A10: 1}})  # a Kata pod that runs on throughout
    held = [c.devices for p in kubelet.state.pods if p.name == "running" for c in p.containers]
    with Arrivals(api, kubelet) as arrivals:
        time.sleep(0.5)
        roll(host, kubelet, agent, old_plugin, plugins, gate=True)
        assert not offered(api)  # withdrawn, and not offered again by a stopped agent
        events = [api.get("events", n, "default") for n in api.names("events")]
        assert any(e["reason"] == "RuntimeClassNotOffered" and "the agent is stopping" in e["message"]
                   for e in events), events
        new = agent_for(host, api)
        assert new.reconcile("start").ok and offered(api)  # the new plugin registered
        time.sleep(0.5)
    assert arrivals.rejected == []
    assert len(arrivals.admitted) >= 10
    assert [c.devices for p in kubelet.state.pods if p.name == "running" for c in p.containers] == held


def test_without_the_gate_pods_arriving_in_the_plugins_gap_are_refused(node):
    host, kubelet, api, plugins = node
    old_plugin = start_plugin(host, kubelet, plugins)
    agent = agent_for(host, api, gate=False)
    assert agent.reconcile("start").ok and offered(api)
    with Arrivals(api, kubelet) as arrivals:
        time.sleep(0.5)
        roll(host, kubelet, agent, old_plugin, plugins, gate=False)
    assert arrivals.rejected, arrivals.admitted
    assert all("requested 1 of nvidia.com/GA102GL_A10, 0 available" in r for r in arrivals.rejected)


def test_with_no_offer_labels_to_take_off_the_plugin_is_told_at_once(node):
    host, _, _, _ = node
    agent = make_agent(host, NAMING, Steps(kata=False, cdi=False), None, offer_gate=True)
    signalled = time.time()
    agent.stand_down()
    assert standdown.withdrawn_since(host, signalled) and time.time() - signalled < 2


def refused_pod(name: str, message: str, asks: dict, *, node: str = NODE, reason: str = "UnexpectedAdmissionError",
                owner: str | None = None) -> dict:
    """A pod as the kubelet leaves one it refused at admission (pkg/kubelet/lifecycle/predicate.go:
    phase Failed, reason UnexpectedAdmissionError, the device manager's error as the message)."""
    meta = {"name": name, "namespace": "tenant", "uid": f"uid-{name}"}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": owner, "uid": "rs",
                                    "controller": True}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"nodeName": node, "containers": [{"name": "main", "image": "x",
                                                       "resources": {"limits": asks}}]},
            "status": {"phase": "Failed", "reason": reason, "message": message}}


def test_pods_the_kubelet_refused_before_the_plugin_registered_are_named_on_the_node_once(node):
    # After a node reboot the kubelet re-admits the pods bound to it in its own order: one asking
    # for our GPUs before the plugin registered is refused, as the kubelet simulator does here.
    from katamgr.cluster.pods import failed_pods_on_node

    host, kubelet, api, plugins = node
    with pytest.raises(AdmissionError) as refusal:
        kubelet.admit_pod("tenant", "bare", {"main": {A10: 1}})
    said = str(refusal.value)
    api.seed(refused_pod("bare", said, {A10: "1"}))
    api.seed(refused_pod("web-5d4f", said, {A10: "1"}, owner="web-5d4f"))
    api.seed(refused_pod("runc", "no nvidia.com/gpu", {"nvidia.com/gpu": "1"}))  # not a resource of ours
    api.seed(refused_pod("oom", "OOMKilled", {A10: "1"}, reason="OOMKilled"))  # failed, not at admission
    api.seed(refused_pod("elsewhere", said, {A10: "1"}, node="gpu-node-2"))  # another node's
    ctx = KataContext(parse_config(kata_manager_yaml((GPU,))), manage_runtime_classes=False)
    agent = make_agent(host, NAMING, Steps(cdi=False), ctx, offer_labels=node_labels(api.client(), NODE),
                       events=EventRecorder(api.client(), NODE), offer_gate=True, rejected_pods="event",
                       failed_pods=lambda: failed_pods_on_node(api.client(), NODE))

    def named() -> list[str]:
        found = [api.get("events", n, "default") for n in api.names("events")]
        return sorted(e["message"] for e in found if e["reason"] == "PodRefusedAtAdmission")

    assert agent.reconcile("start").ok and not offered(api)
    assert named() == []  # the gate is shut: nothing looked for yet
    start_plugin(host, kubelet, plugins)
    agent.follow_offers()
    assert offered(api)
    assert named() == [
        f"The kubelet refused pod tenant/bare (asked for {A10}; the kubelet: {said}): a bare pod stays Failed: "
        "delete it and create it again",
        f"The kubelet refused pod tenant/web-5d4f (asked for {A10}; the kubelet: {said}): its controller "
        "ReplicaSet/web-5d4f replaces it"]
    # The plugin restarts: the gate shuts and opens again; each pod is named once, a new one too.
    plugins.pop().stop()
    kubelet.wait_for(lambda s: not s.healthy(A10))
    agent.follow_offers()
    api.seed(refused_pod("late", said, {A10: "1"}))
    start_plugin(host, kubelet, plugins)
    agent.follow_offers()
    assert len(named()) == 3 and any("tenant/late " in m for m in named())


def test_rejected_pods_needs_the_offer_gate(tmp_path):
    from katamgr.cli import main

    assert main(["run", "--host-root", str(tmp_path), "--rejected-pods", "event", "--once"]) == 2
