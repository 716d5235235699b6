"""The offer gate's simulated node (tests/agent): a simulated a10-server with the real sandbox
device plugin (PluginManager) serving the kubelet simulator over the device plugin gRPC, the
agent offering its classes on a Node of the API stand-in, and Kata pods that a scheduler places
here only while the class's offer label is true (the API server's RuntimeClass admission copies
the class's nodeSelector into the pod: Kubernetes plugin/pkg/admission/runtimeclass). The
kubelet simulator admits as the device manager does (k8s.io/kubernetes v1.35.4
pkg/kubelet/cm/devicemanager/manager.go): a plugin whose stream ended has every device
Unhealthy (``PluginDisconnected``), so a pod admitted then is refused. A pod reaches the
kubelet a moment after it is bound (its API watch)."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time

import grpc

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
from support.agentkit import make_agent
from support.apiserver import FakeApiServer
from support.kataconfig import kata_manager_yaml, prepare_node
from support.passthroughkit import A10, FAST, NAMING, bind

NODE = "gpu-node-1"
BIND_TO_KUBELET = 0.3  # a bound pod reaches the kubelet's pod manager this much later (its watch)


def gate_node():
    """(host, kubelet, api, plugins, root) started; ``close_node`` ends them."""
    root = tempfile.mkdtemp(prefix="og-")  # a socket path must fit in 107 bytes
    materialise(find_profile("a10-server"), root)
    host = prepare_node(open_node(root).host)
    bind(host)
    kubelet = KubeletSimulator(host)
    kubelet.start()
    api = FakeApiServer().__enter__()
    api.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    return host, kubelet, api, [], root


def close_node(kubelet, api, plugins, root) -> None:
    for plugin in plugins:
        plugin.stop()
    kubelet.stop()
    api.__exit__(None, None, None)
    shutil.rmtree(root, ignore_errors=True)


def agent_for(host, api, *, gate: bool = True, **given):
    ctx = KataContext(parse_config(kata_manager_yaml((GPU,))), manage_runtime_classes=False)
    agent = make_agent(host, NAMING, Steps(cdi=False), ctx, offer_labels=node_labels(api.client(), NODE),
                       events=EventRecorder(api.client(), NODE), offer_gate=gate, **given)
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
    is offered, admitted by the kubelet BIND_TO_KUBELET later, done a moment after admission.
    ``bound`` says when each was scheduled (time.monotonic)."""

    def __init__(self, api, kubelet) -> None:
        self.api, self.kubelet = api, kubelet
        self.stop = threading.Event()
        self.admitted: list[str] = []
        self.rejected: list[str] = []  # the kubelet found no healthy device free
        self.broken: list[str] = []  # the plugin's connection broke while admitting
        self.bound: dict[str, float] = {}
        self.threads: list[threading.Thread] = []
        self.count = 0

    def run(self) -> None:
        while not self.stop.is_set():
            if offered(self.api):
                self.count += 1
                name = f"kata-{self.count}"
                self.bound[name] = time.monotonic()
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
        except (grpc.RpcError, KeyError) as exc:  # the plugin went mid-admission: refused too
            self.broken.append(f"{name}: {exc}")
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
