"""A split node (``nvidia.com/gpu.workload.vm-passthrough.gpus``) never has one GPU offered by both
plugins: the kubelet's record of every ListAndWatch update of the passthrough and the container
plugin, replayed in order, never lists a GPU Healthy on both sides, while the split label changes
at random under the agent and both plugins (each following it by its own watch) and pods come and
go on both sides. And after it settles, each side offers exactly its share."""

from __future__ import annotations

import random
import time

from support.hostkit import driver_of
from support.splitkit import CONTAINER_GPU, overlaps, split_node
from support.waiting import wait_for

from nodesim.kubeletstate import AdmissionError

A10 = "nvidia.com/GA102GL_A10"
VALUES = ["0", "1", "2", "3", "4", "all", "index.0_3", "index.1-2", None]


def offered(state, resource: str) -> int:
    return len(state.healthy(resource))


def test_no_gpu_is_offered_by_both_plugins_under_racing_relabels_and_pod_churn(sim_host):
    rng = random.Random(46)
    with split_node(sim_host, "a10-server", "2") as node:
        kubelet = node.kubelet
        kubelet.wait_for(lambda s: offered(s, A10) == 2 and offered(s, CONTAINER_GPU) == 2, timeout=20)
        pods: list[str] = []
        for step in range(16):
            node.relabel(rng.choice(VALUES))
            for _ in range(rng.randint(0, 2)):  # pods on either side come and go meanwhile
                if pods and rng.random() < 0.5:
                    kubelet.remove_pod("default", pods.pop(rng.randrange(len(pods))))
                    continue
                resource = rng.choice([A10, CONTAINER_GPU])
                name = f"pod-{step}-{len(pods)}"
                try:
                    kubelet.admit_pod("default", name, {"main": {resource: 1}})
                    pods.append(name)
                except AdmissionError:
                    pass  # nothing free on that side now
            time.sleep(rng.uniform(0.0, 0.4))
        for name in pods:
            kubelet.remove_pod("default", name)
        node.relabel("1")  # settles: 3 for containers, the last for VMs
        kubelet.wait_for(lambda s: offered(s, A10) == 1 and offered(s, CONTAINER_GPU) == 3, timeout=60)
        assert wait_for(lambda: not node.agent.splitter.leaving and not node.agent.splitter.joining)
        history = kubelet.state.history
    assert len(history) > 10  # both streams were recorded throughout
    assert overlaps(node, history) == []


def test_a_gpu_a_container_pod_holds_joins_the_vm_share_only_once_the_pod_is_gone(sim_host):
    # The agent's next check is an hour away: the GPU a pod held moves by the poll of the GPUs
    # a change keeps waiting, as soon as the pod is gone.
    with split_node(sim_host, "a10-server", "2", check_interval=3600) as node:
        kubelet = node.kubelet
        kubelet.wait_for(lambda s: offered(s, A10) == 2 and offered(s, CONTAINER_GPU) == 2, timeout=20)
        kubelet.admit_pod("default", "cuda", {"main": {CONTAINER_GPU: 1}})
        [uuid] = kubelet.state.pods[0].containers[0].devices[CONTAINER_GPU]
        held = node.bdf_of(uuid)
        node.relabel("all")
        free = next(b for b in node.gpus[:2] if b != held)
        # The free one moves; the pod's stays on nvidia, offered to nobody, while the pod lives.
        kubelet.wait_for(lambda s: offered(s, A10) == 3, timeout=20)
        assert free in {d for d in kubelet.state.healthy(A10)}
        assert driver_of(node.host, held) == "nvidia"
        assert node.agent.splitter.joining == {held}
        kubelet.remove_pod("default", "cuda")
        kubelet.wait_for(lambda s: offered(s, A10) == 4, timeout=20)
        assert driver_of(node.host, held) == "vfio-pci"


def test_one_free_gpu_moves_each_way_without_waiting_for_the_agents_next_check(sim_host):
    """A move is carried out on the relabel itself: katamgr waits for the kubelet to drop the GPU
    from the side it leaves (PodResources ``GetAllocatableResources``) and then moves it, rather
    than finding it withdrawn at a later check (an hour away here)."""
    with split_node(sim_host, "a10-server", "2", check_interval=3600) as node:
        kubelet = node.kubelet
        kubelet.wait_for(lambda s: offered(s, A10) == 2 and offered(s, CONTAINER_GPU) == 2, timeout=20)
        node.relabel("3")  # one GPU to VMs: withdrawn by the container plugin, then bound
        kubelet.wait_for(lambda s: offered(s, A10) == 3 and offered(s, CONTAINER_GPU) == 1, timeout=20)
        assert driver_of(node.host, node.gpus[1]) == "vfio-pci"
        node.relabel("2")  # and back: withdrawn by the passthrough plugin, then given back
        kubelet.wait_for(lambda s: offered(s, A10) == 2 and offered(s, CONTAINER_GPU) == 2, timeout=20)
        assert driver_of(node.host, node.gpus[1]) == "nvidia"


def test_a_gpu_a_kata_pod_was_given_stays_on_vfio_pci_through_a_later_change(sim_host):
    """A GPU that left the VM share while a pod held it (its VM not started yet: no VFIO group
    open) is still that pod's when the split changes again: the kubelet's ``List`` names it under
    the passthrough resource, though the share's own naming no longer has it."""
    with split_node(sim_host, "a10-server", "2", check_interval=3600) as node:
        kubelet = node.kubelet
        kubelet.wait_for(lambda s: offered(s, A10) == 2 and offered(s, CONTAINER_GPU) == 2, timeout=20)
        kubelet.admit_pod("default", "kata", {"main": {A10: 1}})
        [held] = kubelet.state.pods[0].containers[0].devices[A10]
        free = next(b for b in node.gpus[2:] if b != held)
        # The held GPU's side leaves the VM share first, then the other GPU too.
        node.relabel("index.2" if free == node.gpus[2] else "index.3")
        assert wait_for(lambda: node.agent.splitter.leaving == {held})
        node.relabel("0")
        kubelet.wait_for(lambda s: offered(s, CONTAINER_GPU) == 3, timeout=20)
        assert driver_of(node.host, free) == "nvidia"
        time.sleep(2)  # a few of the held GPUs' polls
        assert driver_of(node.host, held) == "vfio-pci" and node.agent.splitter.leaving == {held}
        kubelet.remove_pod("default", "kata")  # the pod ends: its GPU is given back
        kubelet.wait_for(lambda s: offered(s, CONTAINER_GPU) == 4, timeout=20)
        assert driver_of(node.host, held) == "nvidia"
