"""The link policy is one node setting (``--link-policy``, the chart's ``devices.linkPolicy``)
that the device plugin and the agent's hand-back check both take from the node's context, so
a GPU whose PCIe link trained below its maximum is judged alike before and after a tenant:
with ``warn`` it stays offered across a hand-back (the agent's check no longer fails it on the
link alone, as it did while only the plugin took the setting); with ``degrade`` both hold it
out. A simulated a10-server (its sysfs as Linux writes it: ``nodesim.pcierrors``) served to
the kubelet simulator."""

from __future__ import annotations

import shutil
import tempfile

import pytest
from support.agentkit import make_agent
from support.nodecontextkit import katamgr_context, plugin_context

from gpunode.host import handback
from katamgr.pipeline.reconcile import Steps
from nodesim import pcierrors
from nodesim.kubelet import KubeletSimulator
from nodesim.materialise import materialise
from nodesim.node import open_node
from nodesim.profiles import find_profile
from sandbox_plugin.manager import Mode, PluginManager

A10 = "nvidia.com/GA102GL_A10"


@pytest.fixture
def served(request):
    """(host, kubelet, agent) with both programs' context built with ``--link-policy POLICY``."""
    root = tempfile.mkdtemp(prefix="lp-")  # a socket path must fit in 107 bytes
    materialise(find_profile("a10-server"), root)
    host = open_node(root).host
    flags = ("--link-policy", request.param)
    agent_node, plugin_node = katamgr_context(host, None, *flags, command="run"), plugin_context(host, *flags)
    assert agent_node.link_policy == plugin_node.link_policy == request.param
    agent = make_agent(host, agent_node.naming, Steps(kata=False, cdi=False), None,
                       link_policy=agent_node.link_policy)
    assert agent.reconcile("start").ok
    kubelet = KubeletSimulator(host)
    kubelet.start()
    plugin = PluginManager(host, Mode.VM_PASSTHROUGH, naming=plugin_node.naming, health_interval=0.05,
                           link_policy=plugin_node.link_policy)
    plugin.start()
    try:
        kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4)
        yield host, kubelet, agent
    finally:
        plugin.stop()
        kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)


def _tenant_leaves_a_low_link(host, kubelet, agent) -> str:
    agent.follow_gpu_health()
    kubelet.admit_pod("default", "tenant", {"vm": {A10: 1}})
    gpu = next(p for p in kubelet.state.pods if p.name == "tenant").containers[0].devices[A10][0]
    agent.follow_gpu_health()
    pcierrors.limit_link(host, gpu, "8.0 GT/s PCIe", 16)  # below its 16.0 GT/s maximum, reset or not
    kubelet.remove_pod("default", "tenant")
    agent.follow_gpu_health()
    return gpu


@pytest.mark.parametrize("served", ["warn"], indirect=True)
def test_with_warn_a_low_link_stays_offered_across_a_hand_back(served):
    host, kubelet, agent = served
    gpu = _tenant_leaves_a_low_link(host, kubelet, agent)
    verdict = handback.read_verdict(host, gpu)
    assert verdict is not None and verdict.ok, verdict
    kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4, timeout=2)


@pytest.mark.parametrize("served", ["degrade"], indirect=True)
def test_with_degrade_both_hold_a_low_link_out(served):
    host, kubelet, agent = served
    gpu = _tenant_leaves_a_low_link(host, kubelet, agent)
    verdict = handback.read_verdict(host, gpu)
    assert verdict is not None and not verdict.ok and "link" in verdict.reason, verdict
    kubelet.wait_for(lambda s: gpu not in s.healthy(A10), timeout=2)
