"""The offer gate (katamgr.agent.offergate) through a rolling update of the agent's pod, while
Kata pods asking for our GPUs keep arriving: no pod ends in UnexpectedAdmissionError.

The parts (tests/support/offergatekit.py): a simulated a10-server, the real sandbox device
plugin serving the kubelet simulator, the agent offering its classes on a Node of the API
stand-in, and Kata pods scheduled here only while the class's offer label is true.

Without the gate (the plugin stops at once, the labels stay) the same arrivals are refused:
the test can fail.
"""

from __future__ import annotations

import threading
import time

import pytest
from support.agentkit import make_agent
from support.kataconfig import kata_manager_yaml
from support.offergatekit import (
    NODE,
    Arrivals,
    agent_for,
    close_node,
    gate_node,
    offered,
    start_plugin,
)
from support.passthroughkit import A10, NAMING

from gpunode.host import standdown
from gpunode.kataclasses import GPU
from katamgr.cluster import EventRecorder
from katamgr.commands.setup import node_labels
from katamgr.config import parse_config
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.reconcile import Steps
from nodesim.kubeletstate import AdmissionError


@pytest.fixture
def node():
    host, kubelet, api, plugins, root = gate_node()
    yield host, kubelet, api, plugins
    close_node(kubelet, api, plugins, root)


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
