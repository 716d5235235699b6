"""A simulated node with the DRA driver, for tests/plugin/test_dra_*.py.

``DraNode``: a host profile materialised and set up by katamgr (vfio-pci, CDI
specs), the in-process API server stand-in with the Node, the kubelet simulator
with its DRA side (``nodesim.drakubelet``) and a running
``DraDriver``. Claims are seeded into the API stand-in allocated as the scheduler
would write them (``status.allocation.devices.results`` and ``status.reservedFor``).
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from dataclasses import dataclass, field

from support.apiserver import FakeApiServer

from gpunode.host.pciids import PciIds
from gpunode.host.root import HostRoot
from gpunode.policy.naming import Naming
from gpunode.policy.selection import Selection
from katamgr.pipeline.reconcile import Steps, reconcile
from kubeletapi import dra_pb2 as dra
from nodesim.drakubelet import DraKubelet
from nodesim.kubelet import KubeletSimulator
from nodesim.materialise import materialise
from nodesim.profile import HostProfile
from nodesim.profiles import find_profile
from sandbox_plugin.dra.driver import DraDriver

DRIVER = "passthrough.kata-sandbox-manager.io"
NODE = "dgx-1"
# The dgx-h100's NVSwitches opted in (--nvswitches true): the driver publishes them as devices
# of their own type. (By default they stay on the host: Kata before 4.1 fails them.)
NAMING = Naming(PciIds.find(), selection=Selection(nvswitches=True))


@dataclass
class DraNode:
    host: HostRoot
    server: FakeApiServer
    kubelet: KubeletSimulator
    dra: DraKubelet
    naming: Naming = NAMING
    drivers: list[DraDriver] = field(default_factory=list)

    @property
    def driver(self) -> DraDriver:
        return self.drivers[-1]

    def start_driver(self, **options) -> DraDriver:
        options.setdefault("resync_interval", 0.5)
        driver = DraDriver(self.host, self.naming, self.server.client(), driver=DRIVER, node=NODE,
                           **options)
        self.drivers.append(driver)
        driver.start()
        return driver

    def stop_driver(self) -> None:
        self.drivers.pop().stop()

    def slices(self) -> list[dict]:
        return [self.server.get("resourceslices", n) for n in self.server.names("resourceslices")]

    def slice(self) -> dict:
        (only,) = self.slices()
        return only

    def device_names(self, prefix: str = "") -> list[str]:
        return [d["name"] for d in self.slice()["spec"]["devices"] if d["name"].startswith(prefix)]

    def claim(self, name: str, devices: list[str], *, pod_uid: str = "pod-1", driver: str = DRIVER,
              pool: str = NODE, namespace: str = "default", request: str = "gpus",
              pod_name: str = "pod") -> dict:
        """A ResourceClaim allocated ``devices`` of ``driver``'s ``pool``, reserved for the pod."""
        return self.server.seed({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"devices": {"requests": [{"name": request, "exactly": {
                "deviceClassName": f"gpu.{DRIVER}", "count": len(devices)}}]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": request, "driver": driver, "pool": pool, "device": d} for d in devices]}},
                "reservedFor": [{"resource": "pods", "name": pod_name, "uid": pod_uid}]},
        })

    def pod(self, name: str, runtime_class: str | None, namespace: str = "default") -> dict:
        spec: dict = {"containers": [{"name": "c", "image": "busybox"}]}
        if runtime_class:
            spec["runtimeClassName"] = runtime_class
        return self.server.seed({"apiVersion": "v1", "kind": "Pod",
                                 "metadata": {"name": name, "namespace": namespace}, "spec": spec})

    def ref(self, claim: dict, uid: str | None = None) -> dra.Claim:
        meta = claim["metadata"]
        return dra.Claim(namespace=meta["namespace"], name=meta["name"], uid=uid or meta["uid"])

    def claim_reads(self) -> int:
        return len([r for r in self.server.requests
                    if r.method == "GET" and "/resourceclaims/" in r.path])


def make_node(profile: str | HostProfile = "dgx-h100", naming: Naming = NAMING, *,
              start: bool = True, **options) -> tuple[DraNode, callable]:
    """A ``DraNode`` (its driver started unless ``start`` is False) and its cleanup."""
    if not isinstance(profile, HostProfile):
        profile = find_profile(profile)
    directory = tempfile.mkdtemp(prefix="kd-")  # short: unix socket paths are limited
    host = materialise(profile, directory)
    report = reconcile(host, naming, Steps(), None)
    assert report.ok, report.failures
    server = FakeApiServer().start()
    server.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    kubelet = KubeletSimulator(host)
    kubelet.start()
    drakubelet = DraKubelet(host, server.client(), kubelet.record_pod, kubelet.remove_pod)
    drakubelet.start()
    node = DraNode(host, server, kubelet, drakubelet, naming)
    if start:
        node.start_driver(**options)

    def cleanup() -> None:
        while node.drivers:
            node.stop_driver()
        drakubelet.stop()
        kubelet.stop()
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)

    return node, cleanup


def new_uid() -> str:
    return str(uuid.uuid4())
