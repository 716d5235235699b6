"""The node's state as Node conditions (katamgr.agent.conditions), written the way
node-problem-detector writes its own: a strategic merge patch of nodes/status that merges
by condition type, so the kubelet's conditions stay as they are; a write only when one of
ours changed, so a node at rest costs no API request. On the API stand-in, which merges
status.conditions by type as the API server does (NodeStatus.Conditions' patchMergeKey) and
takes only the status from a nodes/status patch (the Node's status strategy)."""

from __future__ import annotations

import pytest
from support.apiserver import FakeApiServer

from gpunode.errors import GpuNodeError
from gpunode.host.pciids import PciIds
from gpunode.policy.naming import Naming
from katamgr.agent.build import build
from katamgr.agent.conditions import (
    GPUS,
    HEALTHY,
    RUNTIME_CLASSES,
    Condition,
    NodeConditions,
    node_conditions,
)
from katamgr.agent.metrics import AgentMetrics
from katamgr.agent.settings import AgentSettings
from katamgr.pipeline.reconcile import Steps
from nodesim import pcierrors
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

NAMING = Naming(PciIds.find())
NODE = "gpu-node-1"
KUBELET_READY = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status",
                 "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}


def conditions(api) -> dict[str, dict]:
    return {c["type"]: c for c in api.get("nodes", NODE)["status"]["conditions"]}


def status_writes(api) -> list:
    return [r for r in api.writes() if r.path == f"/api/v1/nodes/{NODE}/status"]


@pytest.fixture
def cluster(tmp_path):
    host = materialise(find_profile("a10-server"), tmp_path / "host")
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {}},
                  "status": {"conditions": [KUBELET_READY]}})
        agent = build(AgentSettings(host, NAMING, Steps(kata=False, cdi=False), None, follow=False,
                                    node_name=NODE), api.client())
        yield host, api, agent


def test_a_reconcile_publishes_our_conditions_beside_the_kubelets(cluster):
    host, api, agent = cluster
    assert agent.reconcile("start").ok
    found = conditions(api)
    assert found["Ready"] == KUBELET_READY  # the kubelet's, untouched
    assert found[GPUS]["status"] == "True" and found[GPUS]["reason"] == "GPUsBound"
    assert found[GPUS]["message"] == "4 device(s) on vfio-pci for VMs"
    assert found[HEALTHY]["status"] == "True"
    assert found[GPUS]["lastTransitionTime"] == found[GPUS]["lastHeartbeatTime"]
    writes = status_writes(api)
    assert len(writes) == 1 and writes[0].content_type == "application/strategic-merge-patch+json"
    assert {c["type"] for c in writes[0].body["status"]["conditions"]} == {GPUS, HEALTHY}


def test_at_rest_no_request_and_a_change_writes_only_the_condition_that_changed(cluster):
    host, api, agent = cluster
    agent.reconcile("start")
    agent.follow_gpu_health()
    before = conditions(api)
    api.clear_log()
    for _ in range(5):  # checks at rest: not one API request
        agent.follow_gpu_health()
        agent.reconcile("repull")
    assert status_writes(api) == [] and conditions(api) == before
    gpu = "0000:31:00.0"  # one of the a10-server's GPUs
    pcierrors.fall_off_bus(host, gpu)
    agent.follow_gpu_health()
    writes = status_writes(api)
    assert len(writes) == 1
    assert [c["type"] for c in writes[0].body["status"]["conditions"]] == [HEALTHY]
    after = conditions(api)
    assert after[HEALTHY]["status"] == "False" and after[HEALTHY]["reason"] == "GPUUnhealthy"
    assert gpu in after[HEALTHY]["message"]
    assert after[GPUS] == before[GPUS] and after["Ready"] == KUBELET_READY


def test_a_restarted_agent_neither_rewrites_nor_moves_the_transition_time(cluster):
    host, api, agent = cluster
    agent.reconcile("start")
    first = conditions(api)
    api.clear_log()
    again = build(AgentSettings(host, NAMING, Steps(kata=False, cdi=False), None, follow=False,
                                node_name=NODE), api.client())
    again.reconcile("start")
    assert status_writes(api) == []
    assert conditions(api) == first


def test_a_runtime_class_that_failed_is_named_and_a_status_flip_moves_the_transition_time():
    metrics = AgentMetrics()
    metrics.observe_classes(["kata-qemu-nvidia-gpu", "kata-qemu-nvidia-gpu-snp"], ["kata-qemu-nvidia-gpu"])
    (rc,) = node_conditions(metrics, binds=False)
    assert rc == Condition(RUNTIME_CLASSES, "False", "RuntimeClassFailed", rc.message)
    assert "kata-qemu-nvidia-gpu-snp" in rc.message and "kata-qemu-nvidia-gpu," not in rc.message
    written: list[list[dict]] = []
    published = NodeConditions(written.append, lambda: {
        RUNTIME_CLASSES: {"type": RUNTIME_CLASSES, "status": "True", "reason": "RuntimeClassesOffered",
                          "message": "x", "lastTransitionTime": "2020-01-01T00:00:00Z"}})
    published.publish([rc])
    assert written[0][0]["lastTransitionTime"] != "2020-01-01T00:00:00Z"
    published.publish([Condition(RUNTIME_CLASSES, "False", "RuntimeClassFailed", "other message")])
    # Same status, new message: written, the transition time kept.
    assert written[1][0]["lastTransitionTime"] == written[0][0]["lastTransitionTime"]


def test_a_refused_write_is_retried_only_after_the_backoff():
    now = [0.0]
    tries = []

    def refuse(conditions):
        tries.append(conditions)
        raise GpuNodeError("cannot set conditions on node x: forbidden")

    published = NodeConditions(refuse, clock=lambda: now[0])
    wanted = [Condition(GPUS, "True", "GPUsBound", "1 device(s) on vfio-pci for VMs")]
    published.publish(wanted)
    published.publish(wanted)
    assert len(tries) == 1
    now[0] = 301.0
    published.publish(wanted)
    assert len(tries) == 2
