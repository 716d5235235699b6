"""The kubelet's PodResources v1 service, as the kubelet simulator serves it.

Kata's shim (cold-plug) and monitoring agents read this to learn which devices
each pod's containers hold. The kubelet serves it on
``/var/lib/kubelet/pod-resources/kubelet.sock``; this stand-in serves the same
gRPC service (``kubeletapi/podresources.proto``, wire-identical to
``k8s.io/kubelet/pkg/apis/podresources/v1``) from the simulator's records.

Behaviour follows the kubelet's ``pkg/kubelet/apis/podresources/server_v1.go``:

- ``List``: every admitted pod, each container with one ``ContainerDevices`` per
  device (resource name, the one ID, its NUMA node when the plugin gave one);
- ``GetAllocatableResources``: every healthy device the plugins reported (the device
  manager's ``GetAllocatableDevices``, ``allDevices.Filter(healthyDevices)`` in 1.35: a
  plugin that stood down offers none);
- ``Get(pod_name, pod_namespace)``: one pod; an unknown pod is an error whose
  message is ``pod <name> in namespace <namespace> not found`` (a plain Go error,
  so gRPC status UNKNOWN);
- ``dynamic_resources`` of a container (``KubeletPodResourcesDynamicResources``, on
  by default since 1.34): one ``DynamicResource`` per claim the container uses
  (claim name and namespace), with one ``ClaimResource`` per prepared device
  (driver, pool, device, share ID) carrying CDI devices as the kubelet builds them
  in pkg/kubelet/cm/container_manager_linux.go ``GetDynamicResources``: its list of
  CDI devices is made once per driver and grown device by device, so a driver's
  n-th device lists the CDI IDs of its first n devices.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kubeletapi import podresources_pb2 as pr
from kubeletapi import podresources_pb2_grpc as pr_grpc

POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"



@dataclass(frozen=True)
class ListedDevice:
    """One device as a plugin's ListAndWatch listed it: the kubelet's view of it (the
    ``Device`` message's ID, health and first NUMA node)."""

    id: str
    health: str = "Healthy"
    numa_node: int | None = None

    @property
    def healthy(self) -> bool:
        return self.health == "Healthy"

@dataclass(frozen=True)
class ClaimDevice:
    """One device a DRA driver prepared for a claim (its NodePrepareResources answer)."""

    driver: str
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass
class ClaimRecord:
    """A ResourceClaim a container uses, with the devices prepared for it."""

    namespace: str
    name: str
    devices: list[ClaimDevice] = field(default_factory=list)


@dataclass
class ContainerRecord:
    name: str
    # resource name -> device IDs, in the order the kubelet handed them out
    devices: dict[str, list[str]] = field(default_factory=dict)
    # the DRA claims the container uses, in the pod spec's order
    claims: list[ClaimRecord] = field(default_factory=list)


@dataclass
class PodRecord:
    namespace: str
    name: str
    containers: list[ContainerRecord] = field(default_factory=list)


@dataclass(frozen=True)
class Snapshot:
    """What the service answers from: the simulator's pods and devices at one moment."""

    pods: list[PodRecord]
    devices: dict[str, list[ListedDevice]]  # resource -> every device reported


def _entries(resource: str, device_id: str, device: ListedDevice | None) -> list[pr.ContainerDevices]:
    """The kubelet's containerDevicesFromResourceDeviceInstances: one entry per device
    (per NUMA node of it), never several IDs in one entry."""
    if device is None or device.numa_node is None:
        return [pr.ContainerDevices(resource_name=resource, device_ids=[device_id])]
    return [pr.ContainerDevices(resource_name=resource, device_ids=[device_id],
                                topology=pr.TopologyInfo(nodes=[pr.NUMANode(ID=device.numa_node)]))]


def _dynamic(claim: ClaimRecord) -> pr.DynamicResource:
    """GetDynamicResources for one claim: the CDI list grows per driver (module doc)."""
    resources = []
    for driver in dict.fromkeys(d.driver for d in claim.devices):
        cdi_devices: list[pr.CDIDevice] = []
        for device in (d for d in claim.devices if d.driver == driver):
            cdi_devices += [pr.CDIDevice(name=i) for i in device.cdi_ids]
            resource = pr.ClaimResource(cdi_devices=list(cdi_devices), driver_name=driver,
                                        pool_name=device.pool, device_name=device.device)
            if device.share_id is not None:
                resource.share_id = device.share_id
            resources.append(resource)
    return pr.DynamicResource(claim_name=claim.name, claim_namespace=claim.namespace,
                              claim_resources=resources)


def _pod_message(pod: PodRecord, devices: dict[str, list[ListedDevice]]) -> pr.PodResources:
    known = {(name, d.id): d for name, listed in devices.items() for d in listed}
    containers = [
        pr.ContainerResources(name=c.name, devices=[
            entry for resource, ids in c.devices.items() for i in ids
            for entry in _entries(resource, i, known.get((resource, i)))
        ], dynamic_resources=[_dynamic(claim) for claim in c.claims])
        for c in pod.containers
    ]
    return pr.PodResources(name=pod.name, namespace=pod.namespace, containers=containers)


class _Servicer(pr_grpc.PodResourcesListerServicer):
    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def List(self, request, context):
        now = self._snapshot()
        return pr.ListPodResourcesResponse(pod_resources=[_pod_message(p, now.devices) for p in now.pods])

    def GetAllocatableResources(self, request, context):
        now = self._snapshot()
        entries = [e for name, listed in sorted(now.devices.items()) for d in listed
                   if d.healthy for e in _entries(name, d.id, d)]
        return pr.AllocatableResourcesResponse(devices=entries)

    def Get(self, request, context):
        now = self._snapshot()
        for pod in now.pods:
            if (pod.namespace, pod.name) == (request.pod_namespace, request.pod_name):
                return pr.GetPodResourcesResponse(pod_resources=_pod_message(pod, now.devices))
        context.abort(grpc.StatusCode.UNKNOWN,
                      f"pod {request.pod_name} in namespace {request.pod_namespace} not found")


class PodResourcesServer:
    """Serves PodResources v1 on ``socket`` from ``snapshot()``."""

    def __init__(self, socket: Path, snapshot: Callable[[], Snapshot]) -> None:
        self.socket = socket
        self._snapshot = snapshot
        self._server: grpc.Server | None = None

    def start(self) -> None:
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pr_grpc.add_PodResourcesListerServicer_to_server(_Servicer(self._snapshot), server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace=0).wait(5)
        self.socket.unlink(missing_ok=True)
