"""The agent's passthrough health (katamgr.agent.gpuhealth) on its own: the Events an operator
reads on the Node and the metrics the alerts read, for each check, and which GPUs get the
hand-back check between tenants and when.

A simulated a10-server bound to vfio-pci (faults as Linux writes them: nodesim.pcierrors), the
kubelet simulator's PodResources service (what pods hold, given by the device plugin), and the Events as NodeEvents hands
them to its recorder (katamgr.cluster.EventRecorder's ``record``).
"""

from __future__ import annotations

import shutil
import tempfile

import pytest
from support.hostkit import hold
from support.passthroughkit import A10, A10_IDS, FAST, NAMING, bind

from gpunode.host import handback
from katamgr.agent.events import NodeEvents
from katamgr.agent.gpuhealth import CORRECTABLE_ALERT, GpuHealth
from katamgr.agent.metrics import AgentMetrics
from katamgr.agent.target import Target
from katamgr.pipeline.reconcile import Steps
from nodesim import pcierrors
from nodesim.kubelet import KubeletSimulator
from nodesim.materialise import materialise
from nodesim.node import open_node
from nodesim.profiles import find_profile
from sandbox_plugin.manager import Mode, PluginManager

GPU = A10_IDS[1]


class Recorded:
    """The recorder's side of NodeEvents: (type, reason, message) as they would be posted."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def record(self, reason: str, message: str, type_: str, *, limited: bool) -> None:
        self.events.append((type_, reason, message))

    def take(self) -> list[tuple[str, str, str]]:
        out, self.events = self.events, []
        return out


@pytest.fixture
def node():
    """Factory: ``node(link_policy, steps)`` -> (host, kubelet, GpuHealth, Recorded), the device
    plugin serving the GPUs to the kubelet simulator."""
    made = []

    def make(link_policy: str = "degrade", steps: Steps | None = None):
        root = tempfile.mkdtemp(prefix="ag-")  # a socket path must fit in 107 bytes
        materialise(find_profile("a10-server"), root)
        host = open_node(root).host
        bind(host)
        kubelet = KubeletSimulator(host)
        kubelet.start()
        plugin = PluginManager(host, Mode.VM_PASSTHROUGH, naming=NAMING, backoff=FAST)  # the pods' GPUs
        made.append((root, kubelet, plugin))
        plugin.start()
        kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4)
        recorded = Recorded()
        target = Target(host, NAMING, steps or Steps(kata=False, cdi=False), None)
        return host, kubelet, GpuHealth(target, AgentMetrics(), NodeEvents(recorded), link_policy=link_policy), \
            recorded

    yield make
    for root, kubelet, plugin in made:
        plugin.stop()
        kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)


def gauge(agent: GpuHealth, name: str, **labels) -> float | None:
    return agent.metrics.registry.get_sample_value(name, labels)


def test_a_gpu_turning_unfit_and_fit_again_is_an_event_each_way_and_a_gauge(node):
    host, _, agent, recorded = node()
    agent.follow()
    assert recorded.take() == []
    assert gauge(agent, "katamgr_gpu_unhealthy", device=GPU) == 0
    pcierrors.set_reset_methods(host, GPU, "")
    agent.follow()
    agent.follow()  # no change: no second Event
    assert recorded.take() == [("Warning", "GpuUnhealthy", f"{GPU} has no reset method the kernel can use "
                                "(reset_method is empty), so vfio-pci cannot reset it between tenants")]
    assert gauge(agent, "katamgr_gpu_unhealthy", device=GPU) == 1
    assert gauge(agent, "katamgr_gpu_health_transitions_total", device=GPU, health="Unhealthy",
                 reason="NoResetMethod") == 1
    pcierrors.set_reset_methods(host, GPU, "flr bus")
    agent.follow()
    assert recorded.take() == [("Normal", "GpuHealthy", f"{GPU} is fit for a VM again")]
    assert gauge(agent, "katamgr_gpu_unhealthy", device=GPU) == 0


def test_under_warn_a_link_trained_low_is_no_event_and_not_unfit(node):
    host, _, agent, recorded = node("warn")
    agent.follow()
    pcierrors.train_link(host, GPU, "16.0 GT/s PCIe", 8)
    agent.follow()
    assert recorded.take() == []
    assert gauge(agent, "katamgr_gpu_unhealthy", device=GPU) == 0
    pcierrors.train_link(host, GPU, "Unknown", 0)  # a link that is down is never only a warning
    agent.follow()
    assert [r for _, r, _ in recorded.take()] == ["GpuUnhealthy"]


def test_new_aer_errors_are_warned_of_once_and_counted(node):
    host, _, agent, recorded = node()
    agent.follow()
    pcierrors.inject_aer(host, GPU, "fatal", "DLP")
    agent.follow()
    agent.follow()  # no new errors: no new Event
    assert recorded.take() == [("Warning", "GpuAerErrors",
                                f"{GPU} reported 1 new fatal AER error(s) (the kernel's counts: DLP 1)")]
    assert gauge(agent, "katamgr_gpu_aer_errors", device=GPU, severity="fatal") == 1
    assert gauge(agent, "katamgr_gpu_unhealthy", device=GPU) == 0  # a trip is the plugins' to follow


def test_correctable_errors_are_an_event_only_past_the_rate(node):
    host, _, agent, recorded = node()
    agent.follow()
    pcierrors.inject_aer(host, GPU, "correctable", "BadTLP", CORRECTABLE_ALERT)
    agent.follow()
    assert recorded.take() == []
    pcierrors.inject_aer(host, GPU, "correctable", "BadTLP", CORRECTABLE_ALERT + 1)
    agent.follow()
    ((kind, reason, message),) = recorded.take()
    assert (kind, reason) == ("Normal", "GpuAerCorrectable")
    assert message.endswith(f"more than {CORRECTABLE_ALERT} since the last check")
    assert gauge(agent, "katamgr_gpu_aer_errors", device=GPU, severity="correctable") == 2 * CORRECTABLE_ALERT + 1


def test_only_a_gpu_a_pod_let_go_of_since_the_agent_started_is_handed_back(node):
    host, kubelet, agent, recorded = node()
    kubelet.admit_pod("default", "before", {"vm": {A10: 1}})
    agent.follow()  # the first look: what pods hold now
    kubelet.admit_pod("default", "tenant", {"vm": {A10: 1}})
    (gpu,) = next(p for p in kubelet.state.pods if p.name == "tenant").containers[0].devices[A10]
    agent.follow()
    assert all(handback.read_verdict(host, b) is None for b in A10_IDS)  # nothing let go yet
    kubelet.remove_pod("default", "tenant")
    agent.follow()
    assert [b for b in A10_IDS if handback.read_verdict(host, b) is not None] == [gpu]
    assert recorded.take()[-1] == ("Normal", "GpuHandBackChecked",
                                   f"{gpu} passed its hand-back check (sysfs reset, read back sane)")
    assert gauge(agent, "katamgr_gpu_handbacks_total", result="passed") == 1


def test_a_hand_back_waits_while_the_vm_still_holds_the_gpu(node):
    host, kubelet, agent, _ = node()
    agent.follow()
    kubelet.admit_pod("default", "tenant", {"vm": {A10: 1}})
    (gpu,) = kubelet.state.pods[0].containers[0].devices[A10]
    agent.follow()
    group = next(d.iommu_group for d in agent.target.scan().devices if d.bdf == gpu)
    fd = hold(host, group)  # its QEMU has not closed /dev/vfio/<group> yet
    kubelet.remove_pod("default", "tenant")
    agent.follow()
    assert handback.read_verdict(host, gpu) is None
    fd.unlink()  # the VM ended
    agent.follow()
    assert handback.read_verdict(host, gpu).ok


def test_a_failed_hand_back_is_tried_again_at_each_check_until_it_passes(node):
    host, kubelet, agent, recorded = node()
    agent.follow()
    kubelet.admit_pod("default", "tenant", {"vm": {A10: 1}})
    (gpu,) = kubelet.state.pods[0].containers[0].devices[A10]
    agent.follow()
    pcierrors.fail_reset(host, gpu)
    kubelet.remove_pod("default", "tenant")
    agent.follow()
    agent.follow()
    assert gauge(agent, "katamgr_gpu_handbacks_total", result="failed") == 2
    assert gauge(agent, "katamgr_gpu_handback_failed", device=gpu) == 1
    failed = handback.read_verdict(host, gpu)
    assert not failed.ok and failed.code == "HandBackFailed" and "its reset failed" in failed.reason
    pcierrors.fail_reset(host, gpu, False)
    agent.follow()
    agent.follow()  # passed: not checked again
    assert gauge(agent, "katamgr_gpu_handbacks_total", result="passed") == 1
    assert gauge(agent, "katamgr_gpu_handback_failed", device=gpu) == 0
    assert [r for _, r, _ in recorded.take()] == ["GpuHandBackFailed", "GpuHandBackFailed", "GpuHandBackChecked"]


def test_nothing_is_judged_while_the_node_binds_no_gpu(node):
    host, _, agent, recorded = node(steps=Steps(vfio=False, kata=False, cdi=False))
    pcierrors.fall_off_bus(host, GPU)
    agent.follow()
    assert recorded.take() == []
    assert gauge(agent, "katamgr_gpu_unhealthy", device=GPU) is None
