"""The agent's side of passthrough health: Events on the Node when a GPU turns unfit or fit
again, its AER counts as metrics, and the hand-back check between tenants, whose verdict the
device plugin (served here to the kubelet simulator) turns into the GPU's health.

A simulated a10-server (its sysfs as Linux writes it: nodesim.pcierrors), the kubelet
simulator with its PodResources service, and the API stand-in for the Events.
"""

from __future__ import annotations

import pytest
from support.agentkit import make_agent
from support.apiserver import FakeApiServer

from gpunode.host import handback
from gpunode.host.pciids import PciIds
from gpunode.policy.naming import Naming
from katamgr.cluster import EventRecorder
from katamgr.pipeline.reconcile import Steps
from nodesim import pcierrors
from nodesim.kubelet import KubeletSimulator
from nodesim.materialise import materialise
from nodesim.node import open_node
from nodesim.profiles import find_profile
from sandbox_plugin.manager import Mode, PluginManager

NAMING = Naming(PciIds.find())
A10 = "nvidia.com/GA102GL_A10"


@pytest.fixture
def node(tmp_path_factory):
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="kh-")  # a socket path must fit in 107 bytes
    materialise(find_profile("a10-server"), root)
    host = open_node(root).host
    kubelet = KubeletSimulator(host)
    kubelet.start()
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1"}})
        agent = make_agent(host, NAMING, Steps(kata=False, cdi=False), None,
                      events=EventRecorder(api.client(), "gpu-node-1", window=600))
        assert agent.reconcile("start").ok
        plugin = PluginManager(host, Mode.VM_PASSTHROUGH, naming=NAMING, health_interval=0.05)
        plugin.start()
        kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4)
        try:
            yield host, kubelet, agent, api
        finally:
            plugin.stop()
            kubelet.stop()
            shutil.rmtree(root, ignore_errors=True)


def events(api) -> list[tuple[str, str, str]]:
    found = [api.get("events", n, "default") for n in api.names("events")]
    return sorted((e["type"], e["reason"], e["message"]) for e in found if e["reason"].startswith("Gpu"))


def run_pod(kubelet, name: str) -> str:
    kubelet.admit_pod("default", name, {"vm": {A10: 1}})
    pod = next(p for p in kubelet.state.pods if p.name == name)
    return pod.containers[0].devices[A10][0]


def test_a_gpu_a_pod_let_go_of_is_reset_and_read_back_before_it_is_offered_again(node):
    host, kubelet, agent, api = node
    agent.follow_gpu_health()  # what pods hold now: nothing
    gpu = run_pod(kubelet, "tenant-1")
    agent.follow_gpu_health()
    assert handback.read_verdict(host, gpu) is None  # still its pod's
    kubelet.remove_pod("default", "tenant-1")
    agent.follow_gpu_health()
    verdict = handback.read_verdict(host, gpu)
    assert verdict.ok and verdict.reset == "sysfs reset", verdict
    assert ("Normal", "GpuHandBackChecked", f"{gpu} passed its hand-back check (sysfs reset, read back sane)") \
        in events(api)
    samples = {s.name: s.value for m in agent.metrics.registry.collect() for s in m.samples}
    assert samples["katamgr_gpu_handbacks_total"] == 1


def test_a_gpu_that_fails_its_hand_back_stays_out_with_the_reason(node):
    host, kubelet, agent, api = node
    agent.follow_gpu_health()
    gpu = run_pod(kubelet, "tenant-1")
    agent.follow_gpu_health()
    pcierrors.fall_off_bus(host, gpu)  # the last tenant left it wedged
    pcierrors.fail_reset(host, gpu)
    kubelet.remove_pod("default", "tenant-1")
    agent.follow_gpu_health()
    verdict = handback.read_verdict(host, gpu)
    assert not verdict.ok and "its reset failed" in verdict.reason
    kubelet.wait_for(lambda s: gpu not in s.healthy(A10), timeout=2)
    found = events(api)
    assert ("Warning", "GpuUnhealthy", f"{gpu} fell off the bus: its config space reads 0xffff") in found
    assert any(r == "GpuHandBackFailed" and gpu in m and "its reset failed" in m for _, r, m in found), found
    # The gauges the alerts read: unfit now, held out now.
    assert agent.metrics.registry.get_sample_value("katamgr_gpu_unhealthy", {"device": gpu}) == 1
    assert agent.metrics.registry.get_sample_value("katamgr_gpu_handback_failed", {"device": gpu}) == 1
    # The next check tries again; once the reset works it passes and the GPU is offered.
    pcierrors.fail_reset(host, gpu, False)
    agent.follow_gpu_health()
    assert handback.read_verdict(host, gpu).ok
    kubelet.wait_for(lambda s: gpu in s.healthy(A10), timeout=2)
    agent.follow_gpu_health()
    assert ("Normal", "GpuHealthy", f"{gpu} is fit for a VM again") in events(api)
    assert agent.metrics.registry.get_sample_value("katamgr_gpu_unhealthy", {"device": gpu}) == 0
    assert agent.metrics.registry.get_sample_value("katamgr_gpu_handback_failed", {"device": gpu}) == 0


def test_new_aer_errors_are_events_and_the_counts_metrics(node):
    host, kubelet, agent, api = node
    agent.follow_gpu_health()
    gpu = "0000:31:00.0"
    pcierrors.inject_aer(host, gpu, "nonfatal", "CmpltTO")
    pcierrors.inject_aer(host, gpu, "correctable", "BadTLP", 3)  # below the rate: no Event
    agent.follow_gpu_health()
    assert events(api) == [("Warning", "GpuAerErrors", f"{gpu} reported 1 new non-fatal AER error(s) (the kernel's counts: CmpltTO 1)")]
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for m in agent.metrics.registry.collect() for s in m.samples}
    assert samples[("katamgr_gpu_aer_errors", (("device", gpu), ("severity", "correctable")))] == 3
    assert samples[("katamgr_gpu_aer_errors", (("device", gpu), ("severity", "nonfatal")))] == 1
    pcierrors.inject_aer(host, gpu, "correctable", "BadTLP", 500)
    agent.follow_gpu_health()
    assert any(r == "GpuAerCorrectable" for _, r, _m in events(api))
