"""A split node for the overlap test and the split benchmark: a simulated node with its kubelet,
an API server holding its Node, ``katamgr run --workload auto`` following it, and both plugins
following it as the chart runs them (the passthrough plugin ``--auto-modes vm-passthrough``, the
container plugin ``--auto-modes container`` with the simulated NVML), each with its own label
watch, so the three see a relabel at different moments as on a node.

``overlaps(history)`` replays the kubelet's record of every ListAndWatch update of both plugins, in
the order it received them, and returns each moment a GPU was listed by both."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from gpunode.host.pciids import PciIds
from gpunode.policy.naming import Naming
from gpunode.policy.split import SPLIT_LABEL
from gpunode.policy.workload import WORKLOAD_LABEL, Workload, resolve_workload
from gpunode.services.backoff import Backoff
from gpunode.services.kube import NodeLabelWatch
from katamgr.agent import Agent
from katamgr.pipeline.reconcile import Steps
from nodesim.nvml import FakeNvml
from sandbox_plugin.container import RESOURCE_NAME as CONTAINER_GPU
from sandbox_plugin.follow import LabelFollower, PluginRunner
from sandbox_plugin.manager import Mode, PluginManager
from sandbox_plugin.resources import HEALTHY
from sandbox_plugin.splitshare import SplitShare
from support.agentkit import make_agent
from support.apiserver import FakeApiServer

NODE = "split-node"
NAMING = Naming(PciIds.find())


def uuid_of(bdf: str) -> str:
    """The simulated NVML's UUID for the GPU at ``bdf`` (``nodesim.nvml``: made from its address)."""
    return f"GPU-{uuid.uuid5(uuid.NAMESPACE_OID, bdf)}"


@dataclass
class SplitNode:
    host: object
    kubelet: object
    api: FakeApiServer
    agent: Agent
    runners: dict[Mode, PluginRunner]
    devices: list  # the node's GPUs (``Device``), bus order
    stop: threading.Event = field(default_factory=threading.Event)

    def relabel(self, value: str | None) -> None:
        def change(node):
            labels = node["metadata"].setdefault("labels", {})
            if value is None:
                labels.pop(SPLIT_LABEL, None)
            else:
                labels[SPLIT_LABEL] = value
        self.api.update("nodes", NODE, change)

    @property
    def gpus(self) -> list[str]:
        return [d.bdf for d in self.devices]

    def bdf_of(self, device_id: str) -> str:
        return {uuid_of(b): b for b in self.gpus}.get(device_id, device_id)


def _plugin(host, api: FakeApiServer, mode: Mode, stop: threading.Event) -> tuple[PluginRunner, NodeLabelWatch]:
    nvml = FakeNvml.for_simulated_host(host) if mode is Mode.CONTAINER else None
    runner = PluginRunner(lambda m, metrics, held_only=False: PluginManager(
        host, m, naming=NAMING, nvml=nvml, metrics=metrics, held_only=held_only,
        backoff=Backoff(0.05, 2, 0.4), rescan_interval=1.0))
    runner.share = SplitShare(host)
    watch = NodeLabelWatch(api.client(), NODE)
    follower = LabelFollower(runner, lambda: resolve_workload(
        NODE, lambda node: watch.labels(), default=Workload.CONTAINER,
        fallback=lambda: (Workload.VM_PASSTHROUGH, "by hand")), frozenset({mode}))
    watch.on_change = follower.changed.set
    watch.start()
    runner.serve(*follower.first())

    def follow() -> None:
        while not stop.is_set():
            if follower.changed.wait(0.1):
                follower.changed.clear()
                follower.check()
            follower.poll_split()  # as the plugin's main loop does
    threading.Thread(target=follow, name=f"follow-{mode}", daemon=True).start()
    return runner, watch


@contextlib.contextmanager
def split_node(sim_host, profile: str, value: str | None, *, check_interval: float = 0.05) -> Iterator[SplitNode]:
    """``profile``'s node (every GPU on nvidia) labeled vm-passthrough with the split ``value``,
    the agent's first reconcile done and its loop, and both plugins, running. ``check_interval``:
    the agent's checks (the agent's own default is 10 s; quick checks here find held GPUs let go)."""
    host, kubelet = sim_host(profile)
    from gpunode.policy.inventory import discover

    gpus = list(discover(host, NAMING.selection, NAMING.nvswitch_rule).gpus)
    with FakeApiServer() as api:
        labels = {WORKLOAD_LABEL: "vm-passthrough", **({SPLIT_LABEL: value} if value else {})}
        api.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": labels}})
        watch = NodeLabelWatch(api.client(), NODE).start()
        read = lambda: resolve_workload(NODE, lambda node: watch.labels(), default=Workload.CONTAINER,  # noqa: E731
                                        fallback=lambda: (Workload.VM_PASSTHROUGH, "by hand"))
        agent = make_agent(host, NAMING, Steps(kata=False), None, check_interval=check_interval,
                           read_workload=read, node_watch=watch)
        agent.switcher.split_at_start()
        assert agent.reconcile("start").ok
        stop = threading.Event()
        runners, watches = {}, []
        try:
            for mode in (Mode.VM_PASSTHROUGH, Mode.CONTAINER):
                runners[mode], plugin_watch = _plugin(host, api, mode, stop)
                watches.append(plugin_watch)
            thread = threading.Thread(target=agent.loop, daemon=True)
            thread.start()
            yield SplitNode(host, kubelet, api, agent, runners, gpus, stop)
        finally:
            stop.set()
            agent.request_stop()
            for runner in runners.values():
                runner.stop()
            for plugin_watch in watches:
                plugin_watch.stop()
            watch.stop()


class Replay:
    """The kubelet's record of both plugins' ListAndWatch updates (and disconnects), replayed in
    the order it received them; ``feed`` takes the record again and replays only what is new, so a
    long run is replayed whole although the simulator keeps its last 1,000 entries."""

    def __init__(self, node: SplitNode) -> None:
        self.node = node
        self.listed: dict[str, set[str]] = {}
        self.last = float("-inf")
        self.entries = 0
        self.overlaps: list[tuple[float, set[str]]] = []

    def feed(self, history) -> None:
        for when, resource, devices in history:
            if when <= self.last:
                continue
            self.last, self.entries = when, self.entries + 1
            self.listed[resource] = {self.node.bdf_of(i) for i, health in devices if health == HEALTHY}
            container = self.listed.get(CONTAINER_GPU, set())
            vm = set().union(*(v for r, v in self.listed.items() if r != CONTAINER_GPU))
            if container & vm:
                self.overlaps.append((when, container & vm))


def overlaps(node: SplitNode, history) -> list[tuple[float, set[str]]]:
    """Every moment (the kubelet's clock) some GPU was offered by both plugins (listed Healthy: what
    the kubelet hands out; a plugin that stood down has its devices marked Unhealthy): the
    container plugin's UUIDs mapped to addresses, the passthrough plugin's unit IDs (a unit's first
    address) as they are."""
    replay = Replay(node)
    replay.feed(history)
    return replay.overlaps
