"""A kubelet stand-in that speaks the real v1beta1 device plugin gRPC.

No kubelet runs on our build machines, so tests and ``katamgr demo`` use this
instead. It plays the kubelet's side of the contract over real unix sockets in
a host root:

- serves ``Registration`` on ``<root>/var/lib/kubelet/device-plugins/kubelet.sock``
  and, like the kubelet, refuses versions other than ``v1beta1``, invalid
  resource names and endpoints that are not plain file names;
- after a registration, dials the plugin's socket, calls GetDevicePluginOptions
  and consumes ListAndWatch in a thread, keeping the latest devices per resource;
  a newer registration of the same resource becomes the resource's plugin while the
  older connection stays open and its updates still count, and when any connection
  of a resource ends the plugin registered for it then is dropped (its connection
  closed, its devices Unhealthy), as the kubelet's ``runClient`` does;
- ``allocate`` / ``preferred`` / ``pre_start`` call the plugin as the kubelet
  would when admitting a pod;
- a plugin whose ListAndWatch stream ends (it stood down, or died) has its devices
  marked Unhealthy, as the kubelet's ``PluginDisconnected`` does: none is allocated,
  none is listed as allocatable by PodResources;
- ``restart()`` does what a restarting kubelet does to the dir: stop, delete
  every socket in it, serve a new ``kubelet.sock``; and admits its running pods
  again against the allocatable it last reported, ending those that no longer fit;
- ``admit_pod`` admits a pod as the device manager does (free healthy devices,
  the plugin's preferred allocation, one Allocate per container) and records
  it; the PodResources v1 service on
  ``<root>/var/lib/kubelet/pod-resources/kubelet.sock`` answers from those
  records (``nodesim.podresources``);
- ``record_pod`` records a pod admitted by the simulator's DRA side
  (``nodesim.drakubelet``: the plugin watcher, DRA driver
  registration and NodePrepareResources), whose claims' devices PodResources then
  reports as ``dynamic_resources``.

Tests wait for observable state with ``wait_for(lambda state: ..., timeout)``.
"""

from __future__ import annotations

import copy
import logging
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import replace

import grpc

from gpunode.host.root import HostRoot
from gpunode.k8snames import is_extended_resource_name
from kubeletapi import deviceplugin_pb2 as pb
from kubeletapi import deviceplugin_pb2_grpc as pb_grpc
from kubeletapi.deviceplugin_paths import API_VERSION, DEVICE_PLUGIN_DIR, KUBELET_SOCKET
from nodesim.kubeletstate import HISTORY, AdmissionError, KubeletState, PluginOptions, Registration
from nodesim.pluginclient import PluginClient
from nodesim.podresources import (
    POD_RESOURCES_SOCKET,
    ContainerRecord,
    ListedDevice,
    PodRecord,
    PodResourcesServer,
    Snapshot,
)

log = logging.getLogger(__name__)

SUPPORTED_VERSIONS = (API_VERSION,)


class _RegistrationServicer(pb_grpc.RegistrationServicer):
    def __init__(self, sim: KubeletSimulator) -> None:
        self.sim = sim

    def Register(self, request, context):
        problem = self.sim._check(request)
        if problem:
            self.sim._record_rejection(request, problem)
            # The kubelet returns a plain Go error, which gRPC sends as UNKNOWN.
            context.abort(grpc.StatusCode.UNKNOWN, problem)
        self.sim._accept(request)
        return pb.Empty()


class KubeletSimulator:
    """A simulated kubelet device manager in ``host_root``; see the module doc."""

    def __init__(self, host_root: HostRoot) -> None:
        self.host_root = host_root
        self.socket_dir = host_root.path(DEVICE_PLUGIN_DIR)
        self.kubelet_socket = self.socket_dir / KUBELET_SOCKET
        self._cond = threading.Condition()
        self._state = KubeletState()
        self._endpoints: dict[str, PluginClient] = {}  # the plugin registered for each resource
        self._open: set[PluginClient] = set()  # every connection not yet ended, stale ones too
        self._server: grpc.Server | None = None
        self.pod_resources_socket = host_root.path(POD_RESOURCES_SOCKET)
        self._pod_resources = PodResourcesServer(self.pod_resources_socket, self._snapshot)

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> None:
        """Serve kubelet.sock (replacing a stale one); plugin sockets are left alone."""
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.kubelet_socket.unlink()
        except FileNotFoundError:
            pass
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_RegistrationServicer_to_server(_RegistrationServicer(self), server)
        server.add_insecure_port(f"unix://{self.kubelet_socket}")
        server.start()
        self._server = server
        self._pod_resources.start()

    def stop(self, keep_socket: bool = False) -> None:  # keep_socket: as a kubelet stopping
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace=0).wait(5)
        self._pod_resources.stop()
        with self._cond:
            endpoints = list(self._open)
            for name in self._endpoints:
                self._mark_unhealthy(name)
            self._endpoints.clear()
            self._open.clear()
        for endpoint in endpoints:
            endpoint.close()
        if keep_socket:
            return
        try:
            self.kubelet_socket.unlink()
        except FileNotFoundError:
            pass

    def restart(self, down: float = 0.0) -> None:
        """Stop, stay down ``down`` s (its sockets left), delete every socket in the dir as a
        starting kubelet does (k8s.io/kubernetes v1.35.4 devicemanager ``CleanupPluginDirectory``),
        serve again, and admit the running pods again as a restarted kubelet does (``_readmit``)."""
        with self._cond:  # what the Node showed: read before stopping marks every device Unhealthy
            reported = {name: sum(d.healthy for d in devices) for name, devices in self._state.devices.items()}
        self.stop(keep_socket=down > 0)
        time.sleep(down)
        for entry in self.socket_dir.iterdir():
            try:
                if stat.S_ISSOCK(entry.lstat().st_mode):
                    entry.unlink()
            except FileNotFoundError:
                pass
        with self._cond:
            self._readmit(reported)
            self._state.devices.clear()
            self._state.restarts += 1
            self._cond.notify_all()
        self.start()

    def _readmit(self, allocatable: dict[str, int]) -> None:
        """A restarted kubelet admits its running pods again against the Node's allocatable
        as it last reported it (the healthy devices before the restart), in admission order,
        and ends a pod that no longer fits, "OutOf<resource>" (k8s.io/kubernetes v1.35.4
        pkg/kubelet/lifecycle/predicate.go; a resource the Node does not list at all is
        left out of the check, removeMissingExtendedResources). Seen on tests/node: a Kata
        pod holding a GPU whose plugin had stood down was ended on a kubelet restart. (The
        same re-admission checks the pod's node selector, which this simulator, holding no
        Node labels, does not model.)"""
        used: dict[str, int] = {}
        kept = []
        for pod in self._state.pods:
            need: dict[str, int] = {}
            for container in pod.containers:
                for resource, ids in container.devices.items():
                    need[resource] = need.get(resource, 0) + len(ids)
            short = [r for r, n in need.items() if r in allocatable and used.get(r, 0) + n > allocatable[r]]
            if short:
                self._state.ended.append((pod, f"OutOf{short[0]}"))
                continue
            kept.append(pod)
            for resource, n in need.items():
                used[resource] = used.get(resource, 0) + n
        self._state.pods = kept

    def __enter__(self) -> KubeletSimulator:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # -- observing --------------------------------------------------------------

    @property
    def state(self) -> KubeletState:
        with self._cond:
            return copy.deepcopy(self._state)

    def wait_for(
        self, predicate: Callable[[KubeletState], bool], timeout: float = 5.0
    ) -> KubeletState:
        """Wait until ``predicate(state)`` holds; return that state or raise TimeoutError."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self._state):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"kubelet-sim state never matched in {timeout} s: {self._state}"
                    )
                self._cond.wait(remaining)
            return copy.deepcopy(self._state)

    # -- acting like the kubelet on pod admission ------------------------------

    def allocate(
        self, resource_name: str, device_ids: Sequence[str]
    ) -> pb.ContainerAllocateResponse:
        """Allocate for one container; a refusal raises grpc.RpcError."""
        response = self.allocate_containers(resource_name, [device_ids])
        return response.container_responses[0]

    def allocate_containers(
        self, resource_name: str, containers: Sequence[Sequence[str]]
    ) -> pb.AllocateResponse:
        request = pb.AllocateRequest(
            container_requests=[
                pb.ContainerAllocateRequest(devices_ids=list(c)) for c in containers
            ]
        )
        return self._stub(resource_name).Allocate(request, timeout=5)

    def preferred(
        self,
        resource_name: str,
        available: Sequence[str],
        must_include: Sequence[str] = (),
        size: int = 1,
    ) -> list[str]:
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=list(available),
                    must_include_deviceIDs=list(must_include),
                    allocation_size=size,
                )
            ]
        )
        response = self._stub(resource_name).GetPreferredAllocation(request, timeout=5)
        return list(response.container_responses[0].deviceIDs)

    def admit_pod(
        self, namespace: str, name: str, containers: dict[str, dict[str, int]]
    ) -> dict[str, dict[str, pb.ContainerAllocateResponse]]:
        """Admit a pod whose containers request ``{container: {resource: count}}``.

        As the device manager does: pick from the healthy devices no other pod
        holds, asking the plugin's GetPreferredAllocation when it offers one,
        then one Allocate per container and resource; PreStartContainer when
        the plugin asked for it. Returns the Allocate answers by container and
        resource; raises AdmissionError (nothing recorded) when a request
        cannot be met or a plugin refuses.
        """
        pod = PodRecord(namespace, name)
        answers: dict[str, dict[str, pb.ContainerAllocateResponse]] = {}
        held = {(r, i) for p in self.state.pods for c in p.containers for r, ids in c.devices.items() for i in ids}
        for container, requests in containers.items():
            record = ContainerRecord(container)
            for resource, count in requests.items():
                state = self.state
                free = [d for d in state.healthy(resource) if (resource, d) not in held]
                if len(free) < count:
                    raise AdmissionError(
                        f"pod {namespace}/{name} container {container}: requested {count} of {resource}, "
                        f"{len(free)} available")
                options = state.options.get(resource, PluginOptions())
                chosen = (self.preferred(resource, free, size=count)
                          if options.get_preferred_allocation_available else free[:count])
                try:
                    answer = self.allocate(resource, chosen)
                    if options.pre_start_required:
                        self.pre_start(resource, chosen)
                except grpc.RpcError as exc:
                    raise AdmissionError(f"pod {namespace}/{name} container {container}: "
                                         f"{resource} plugin refused: {exc.details()}") from exc
                held |= {(resource, i) for i in chosen}
                record.devices[resource] = list(chosen)
                answers.setdefault(container, {})[resource] = answer
            pod.containers.append(record)
        with self._cond:
            self._state.pods.append(pod)
            self._cond.notify_all()
        return answers

    def record_pod(self, pod: PodRecord) -> None:
        """Record a pod admitted elsewhere (the DRA side: ``drakubelet.DraKubelet``)."""
        with self._cond:
            self._state.pods.append(pod)
            self._cond.notify_all()

    def remove_pod(self, namespace: str, name: str) -> None:
        with self._cond:
            self._state.pods = [p for p in self._state.pods if (p.namespace, p.name) != (namespace, name)]
            self._cond.notify_all()

    def _snapshot(self) -> Snapshot:
        with self._cond:
            return Snapshot(copy.deepcopy(self._state.pods), copy.deepcopy(self._state.devices))

    def pre_start(self, resource_name: str, device_ids: Sequence[str]) -> None:
        request = pb.PreStartContainerRequest(devices_ids=list(device_ids))
        self._stub(resource_name).PreStartContainer(request, timeout=5)

    def _stub(self, resource_name: str) -> pb_grpc.DevicePluginStub:
        with self._cond:
            endpoint = self._endpoints.get(resource_name)
        if endpoint is None:
            raise KeyError(f"no plugin is registered for {resource_name!r}")
        return endpoint.stub

    # -- called from gRPC threads -----------------------------------------------

    def _check(self, request: pb.RegisterRequest) -> str | None:
        if request.version not in SUPPORTED_VERSIONS:
            return (
                f"requested API version {request.version!r} is not supported by kubelet. "
                f"Supported versions are {list(SUPPORTED_VERSIONS)}"
            )
        if not is_extended_resource_name(request.resource_name):
            return f"the ResourceName {request.resource_name!r} is invalid"
        if not request.endpoint or "/" in request.endpoint or request.endpoint in (".", ".."):
            return f"invalid endpoint {request.endpoint!r}: it must be a socket file name"
        return None

    def _accept(self, request: pb.RegisterRequest) -> None:
        registration = Registration(
            version=request.version,
            endpoint=request.endpoint,
            resource_name=request.resource_name,
            options=PluginOptions(
                get_preferred_allocation_available=request.options.get_preferred_allocation_available,
                pre_start_required=request.options.pre_start_required,
            ),
            at=time.monotonic(),
        )
        endpoint = PluginClient(self, registration, self.socket_dir / request.endpoint)
        # As the kubelet (k8s.io/kubernetes v1.35.4, pkg/kubelet/cm/devicemanager/plugin/v1beta1/
        # handler.go connectClient -> registerClient): the new client takes the resource's place;
        # an older connection of it is left open, not closed.
        with self._cond:
            self._endpoints[request.resource_name] = endpoint
            self._open.add(endpoint)
            self._state.registrations.append(registration)
            self._cond.notify_all()
        endpoint.start()

    def _record_rejection(self, request: pb.RegisterRequest, problem: str) -> None:
        with self._cond:
            self._state.rejections.append(
                (request.version, request.endpoint, request.resource_name, problem)
            )
            self._cond.notify_all()

    def _record_options(self, resource_name: str, options: PluginOptions) -> None:
        with self._cond:
            self._state.options[resource_name] = options
            self._cond.notify_all()

    def _record_devices(self, endpoint: PluginClient, devices: list[ListedDevice]) -> None:
        name = endpoint.registration.resource_name
        with self._cond:
            if endpoint not in self._open:
                return  # ended meanwhile
            # The kubelet takes a ListAndWatch update by its resource's name, from a connection a
            # newer registration replaced too (manager.go PluginListAndWatchReceiver).
            self._state.devices[name] = devices
            self._state.updates[name] = self._state.updates.get(name, 0) + 1
            self._state.history.append((time.monotonic(), name, tuple((d.id, d.health) for d in devices)))
            del self._state.history[:-HISTORY]
            self._state.connected.add(name)
            self._cond.notify_all()

    def _record_disconnect(self, endpoint: PluginClient) -> None:
        """A connection's stream ended. As the kubelet's ``runClient`` (k8s.io/kubernetes
        v1.35.4, pkg/kubelet/cm/devicemanager/plugin/v1beta1/handler.go): the client registered
        for the resource now is disconnected, whichever it is, this one or a later registration
        (whose connection is then closed, and whose own end drops whatever registered after it),
        and the resource's devices are marked Unhealthy (``PluginDisconnected``)."""
        name = endpoint.registration.resource_name
        with self._cond:
            self._open.discard(endpoint)
            current = self._endpoints.pop(name, None)
            if current is not None:
                self._mark_unhealthy(name)
            self._cond.notify_all()
        if current is not None and current is not endpoint:
            threading.Thread(target=current.close, daemon=True).start()

    def drop(self, resource_name: str) -> None:
        """Disconnect the plugin registered for ``resource_name`` as the kubelet's ``runClient``
        does when another connection of that resource ends (see ``_record_disconnect``)."""
        with self._cond:
            current = self._endpoints.pop(resource_name, None)
            if current is not None:
                self._mark_unhealthy(resource_name)
            self._cond.notify_all()
        if current is not None:
            current.close()

    def _mark_unhealthy(self, name: str) -> None:
        """(Under the lock.) As the kubelet: a plugin disconnected has every device Unhealthy
        (pkg/kubelet/cm/devicemanager/manager.go PluginDisconnected -> markResourceUnhealthy),
        so none is allocated or listed as allocatable; in the record too, in order."""
        self._state.connected.discard(name)
        self._state.devices[name] = [replace(d, health="Unhealthy") for d in self._state.devices.get(name, [])]
        self._state.history.append((time.monotonic(), name, tuple(
            (d.id, d.health) for d in self._state.devices[name])))
        del self._state.history[:-HISTORY]
