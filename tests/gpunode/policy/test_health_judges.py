"""One GPU, three judges, one verdict: the device plugin (its health at ListAndWatch, served
over real gRPC to the kubelet simulator), the agent (its metrics: katamgr_gpu_unhealthy and
the transitions' reason) and the hand-back check between tenants all read the node's health
policy (gpunode.policy.health), so the same facts under the same link policy are judged the
same way by each.

A simulated a10-server bound to vfio-pci (nodesim.pcierrors writes the faults as Linux does).
"""

from __future__ import annotations

import shutil
import tempfile
import time

import pytest
from support.passthroughkit import A10, A10_IDS, FAST, NAMING, bind, health

from gpunode.host import handback
from gpunode.policy import health as policy
from katamgr.agent.events import NodeEvents
from katamgr.agent.gpuhealth import GpuHealth
from katamgr.agent.metrics import AgentMetrics
from katamgr.agent.target import Target
from katamgr.pipeline.reconcile import Steps
from nodesim import pcierrors
from nodesim.kubelet import KubeletSimulator
from nodesim.materialise import materialise
from nodesim.node import open_node
from nodesim.profiles import find_profile
from sandbox_plugin.manager import Mode, PluginManager
from sandbox_plugin.metrics import PluginMetrics
from sandbox_plugin.resources import HEALTHY, UNHEALTHY

GPU = A10_IDS[1]
POLLS = 0.3  # several of the plugin's polls (every 0.05 s here)


@pytest.fixture
def node():
    """Factory: ``node(plugin_policy, agent_policy)`` -> (host, kubelet, plugin, agent's GpuHealth)."""
    made = []

    def make(plugin_policy: str, agent_policy: str):
        root = tempfile.mkdtemp(prefix="hj-")  # a socket path must fit in 107 bytes
        materialise(find_profile("a10-server"), root)
        host = open_node(root).host
        bind(host)
        kubelet = KubeletSimulator(host)
        kubelet.start()
        plugin = PluginManager(host, Mode.VM_PASSTHROUGH, naming=NAMING, backoff=FAST, link_policy=plugin_policy,
                               health_interval=0.05)
        made.append((root, kubelet, plugin))
        plugin.start()
        kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4)
        agent = GpuHealth(Target(host, NAMING, Steps(kata=False, cdi=False), None), AgentMetrics(), NodeEvents(),
                          link_policy=agent_policy)
        agent.follow()  # what pods hold now: nothing
        return host, kubelet, plugin, agent

    yield make
    for root, kubelet, plugin in made:
        plugin.stop()
        kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)


def plugin_says(kubelet, plugin, bdf: str = GPU) -> tuple[str, str]:
    """(health at the kubelet, the reason of the plugin's last transition for ``bdf``)."""
    time.sleep(POLLS)
    codes = [(labels, value) for labels, value in plugin.metrics.health_transitions.snapshot() if labels[0] == bdf]
    last = codes[-1][0][2] if codes else ""
    return health(kubelet.state, A10)[bdf], last


def agent_says(agent: GpuHealth, bdf: str = GPU) -> tuple[str, str]:
    """(Unhealthy or Healthy by katamgr_gpu_unhealthy, the reason its transitions counted; each
    case here has one)."""
    agent.follow()
    registry = agent.metrics.registry
    unfit = registry.get_sample_value("katamgr_gpu_unhealthy", {"device": bdf})
    reasons = {s.labels["reason"] for m in registry.collect() for s in m.samples
               if s.name == "katamgr_gpu_health_transitions_total" and s.labels["device"] == bdf
               and s.labels["health"] == "Unhealthy"}
    assert len(reasons) <= 1, reasons
    return (UNHEALTHY, reasons.pop()) if unfit else (HEALTHY, "")


# (fault, under degrade, under warn, after a hand-back under degrade, under warn): "" Healthy,
# else the reason every judge must give.
CASES = [
    ("link the slot holds low", lambda h: pcierrors.limit_link(h, GPU, "16.0 GT/s PCIe", 8),
     policy.LINK_DEGRADED, "", policy.LINK_DEGRADED, ""),
    ("link retrained low once", lambda h: pcierrors.train_link(h, GPU, "8.0 GT/s PCIe", 16),
     policy.LINK_DEGRADED, "", "", ""),
    ("reset methods off", lambda h: pcierrors.set_reset_methods(h, GPU, ""),
     policy.NO_RESET, policy.NO_RESET, policy.NO_RESET, policy.NO_RESET),
    ("fell off the bus", lambda h: pcierrors.fall_off_bus(h, GPU), policy.OFF_BUS, policy.OFF_BUS, "", ""),
]


@pytest.mark.parametrize("link_policy", ["degrade", "warn"])
@pytest.mark.parametrize(("fault", "degrade", "warn", "after_degrade", "after_warn"),
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_the_plugin_the_agent_and_the_hand_back_judge_a_gpu_alike(node, link_policy, fault, degrade, warn,
                                                                    after_degrade, after_warn):
    host, kubelet, plugin, agent = node(link_policy, link_policy)
    fault(host)
    want = degrade if link_policy == "degrade" else warn
    expected = (UNHEALTHY if want else HEALTHY, want)
    assert plugin_says(kubelet, plugin) == expected
    assert agent_says(agent) == expected
    verdict = agent.policy.hand_back(host, GPU, None)  # what the agent runs once a tenant left
    handback.write_verdict(host, verdict)
    want = after_degrade if link_policy == "degrade" else after_warn
    assert (verdict.ok, verdict.code) == (not want, want)
    expected = (UNHEALTHY if want else HEALTHY, want)
    assert plugin_says(kubelet, plugin) == expected
    assert agent_says(agent) == expected


def tenant_leaves(kubelet, agent: GpuHealth) -> str:
    """A pod gets one GPU, ends; the agent's next check hands it back. Returns the GPU."""
    kubelet.admit_pod("default", "tenant", {"vm": {A10: 1}})
    (gpu,) = kubelet.state.pods[0].containers[0].devices[A10]
    agent.follow()
    kubelet.remove_pod("default", "tenant")
    agent.follow()
    return gpu


@pytest.mark.parametrize("agent_policy", ["warn", "degrade"])
def test_under_warn_a_gpu_whose_link_trained_low_stays_healthy_after_its_first_tenant(node, agent_policy):
    """Every GPU's link trained at x8 of x16 (a riser that carries no more), the node's link
    policy warn: the plugin lists them Healthy, a tenant uses one and leaves, the agent's
    hand-back resets it and it retrains at x8 again. It must stay Healthy, and not become
    Unhealthy (HandBackFailed) for good. Under the same policy the hand-back passes; an agent
    still judging by degrade (not told the node's policy) fails it for its link, and the
    plugin, under warn, does not hold that against it."""
    host, kubelet, plugin, agent = node("warn", agent_policy)
    for bdf in A10_IDS:
        pcierrors.limit_link(host, bdf, "16.0 GT/s PCIe", 8)
    time.sleep(POLLS)
    assert sorted(kubelet.state.healthy(A10)) == A10_IDS
    gpu = tenant_leaves(kubelet, agent)
    verdict = handback.read_verdict(host, gpu)
    assert verdict is not None and verdict.reset == "sysfs reset"
    assert verdict.ok == (agent_policy == "warn"), verdict
    time.sleep(POLLS)
    assert sorted(kubelet.state.healthy(A10)) == A10_IDS
    assert plugin_says(kubelet, plugin, gpu) == (HEALTHY, "")
    # The next tenant gets it.
    kubelet.admit_pod("default", "next", {"vm": {A10: 4}})


def test_both_programs_metrics_name_the_reasons_from_the_policys_one_list():
    """What an operator reads in /metrics' HELP is the policy's list: the agent counts the
    reasons that last while their fact does; the plugin those and the trips and hand-backs."""
    agent = next(m.documentation for m in AgentMetrics().registry.collect()
                 if m.name == "katamgr_gpu_health_transitions")
    said = agent[agent.index("by reason: ") + 11:agent.index(")")].split(", ")
    assert said == list(policy.codes(policy.LASTING))
    plugin = PluginMetrics().health_transitions.documentation
    said = plugin[plugin.index("by reason: ") + 11:plugin.index(")")].split(", ")
    assert said == [r.code for r in policy.REASONS if r.lasts != policy.WARNING]
