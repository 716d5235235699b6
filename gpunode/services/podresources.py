"""Which devices the kubelet has given to the pods on this node: PodResources v1 ``List``.

A workload switch must not take a GPU from a pod that was given it. A running Kata VM
shows by holding its ``/dev/vfio`` node open (``vfio.vfio_holders``), but between
admission and QEMU opening the node (image pull, VM boot) only the kubelet knows: its
PodResources service on ``/var/lib/kubelet/pod-resources/kubelet.sock`` (the API in
``kubeletapi/podresources.proto``, Kubernetes ``pkg/kubelet/apis/podresources/server_v1.go``:
``List`` answers every pod the kubelet admitted, each container with the resource name
and device IDs its device plugins handed out).

Asking is always bounded: a missing socket is answered at once, a socket nobody serves
fails on connect, and a kubelet that does not answer within ``timeout`` is given up on.
The call is grpcwire's, the gRPC the device plugin serves on too. Each of those comes back as
``PodDevices.unknown``, a sentence saying why, for the caller to report; it never raises.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from gpunode.host.root import HostRoot
from gpunode.policy.inventory import Inventory
from gpunode.policy.naming import Naming
from gpunode.policy.passthrough import resource_units

POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
# Below the kubelet's root dir wherever it is (kubelet_getters.go getPodResourcesDir).
SOCKET_BELOW_KUBELET_DIR = "pod-resources/kubelet.sock"
DEFAULT_TIMEOUT = 5.0


@dataclass(frozen=True)
class Assignment:
    """One device the kubelet gave one container."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_id: str

    def __str__(self) -> str:
        return f"pod {self.namespace}/{self.pod} (container {self.container}, {self.resource})"


@dataclass(frozen=True)
class PodDevices:
    """The kubelet's answer; ``unknown`` says why there is none (no socket, no answer)."""

    assignments: tuple[Assignment, ...] = ()
    unknown: str | None = None


# The PodResourcesLister service of kubeletapi/podresources.proto (package v1).
_METHODS = {"List": "/v1.PodResourcesLister/List",
            "GetAllocatableResources": "/v1.PodResourcesLister/GetAllocatableResources"}


def _ask(host: HostRoot, method: str, timeout: float, socket: str | None):
    """(the answer, None) of one PodResources call, or (None, why) when the kubelet could not
    be asked (no socket, no answer within ``timeout``, an error). ``socket`` None: below the
    host's kubelet dir."""
    socket = socket or f"{host.kubelet_dir.rstrip('/')}/{SOCKET_BELOW_KUBELET_DIR}"
    path = host.path(socket)
    if not path.exists():
        return None, f"the kubelet's PodResources socket {socket} does not exist"
    # Imported here: the generated messages load protobuf, which `katamgr plan` and every
    # other command not switching a workload should not pay for.
    from google.protobuf.message import DecodeError

    from grpcwire.client import unary_call
    from grpcwire.status import RpcError, StatusCode
    from kubeletapi import podresources_pb2 as pr

    request, answer = {
        "List": (pr.ListPodResourcesRequest, pr.ListPodResourcesResponse),
        "GetAllocatableResources": (pr.AllocatableResourcesRequest, pr.AllocatableResourcesResponse),
    }[method]
    try:
        raw = unary_call(str(path), _METHODS[method], request().SerializeToString(), timeout)
        return answer.FromString(raw), None
    except RpcError as exc:
        why = (f"no answer within {timeout:g} s" if exc.code is StatusCode.DEADLINE_EXCEEDED
               else f"{exc.code.name}: {exc.details}")
    except OSError as exc:  # nobody serves the socket: what gRPC calls UNAVAILABLE
        why = f"UNAVAILABLE: {exc.strerror or exc}"
    except DecodeError as exc:
        why = f"an answer that is not a {answer.__name__}: {exc}"
    return None, f"the kubelet's PodResources {method} on {socket} failed ({why})"


def list_pod_devices(host: HostRoot, *, timeout: float = DEFAULT_TIMEOUT,
                     socket: str | None = None) -> PodDevices:
    """Every device of every pod, by the kubelet's PodResources ``List``, within ``timeout``."""
    answer, why = _ask(host, "List", timeout, socket)
    if answer is None:
        return PodDevices(unknown=why)
    return PodDevices(tuple(
        Assignment(pod.namespace, pod.name, container.name, devices.resource_name, device_id)
        for pod in answer.pod_resources
        for container in pod.containers
        for devices in container.devices
        for device_id in devices.device_ids
    ))


def kubelet_pods(host: HostRoot, *, timeout: float = DEFAULT_TIMEOUT,
                 socket: str | None = None) -> frozenset[tuple[str, str]] | None:
    """(namespace, name) of every pod the kubelet holds, device or not (``List`` reads its pod
    manager, which holds a pod from its admission on); None when it cannot be asked."""
    answer, _ = _ask(host, "List", timeout, socket)
    if answer is None:
        return None
    return frozenset((pod.namespace, pod.name) for pod in answer.pod_resources)


def offered_devices(host: HostRoot, *, timeout: float = DEFAULT_TIMEOUT,
                    socket: str | None = None) -> tuple[frozenset[str], str | None]:
    """The device IDs the kubelet can hand out now: PodResources ``GetAllocatableResources``,
    which lists only the healthy devices of its plugins (pkg/kubelet/cm/devicemanager
    manager.go ``GetAllocatableDevices``); a plugin that stood down has none there
    (``PluginDisconnected`` marks them all Unhealthy). ``(ids, None)``, or ``(empty, why)``
    when the kubelet could not be asked."""
    answer, why = _ask(host, "GetAllocatableResources", timeout, socket)
    if answer is None:
        return frozenset(), why
    return frozenset(i.lower() for d in answer.devices for i in d.device_ids), None


def wait_not_offered(host: HostRoot, ids: Iterable[str], *, timeout: float, every: float = 0.05,
                     cancelled=None, clock=time.monotonic) -> list[str]:
    """Wait until the kubelet offers none of ``ids`` to a new pod (the device plugin
    serving them stood down, or lists only those pods were given: a device given to a pod
    is never given to another), so that no pod can be given one after the kubelet's
    ``List`` is read. Returns the IDs still offered free when ``timeout`` passed or
    ``cancelled()`` said to stop waiting; empty once none is (or when the kubelet cannot be
    asked: then ``List`` fails too, and says so)."""
    wanted = {i.lower() for i in ids}
    deadline = clock() + timeout
    while True:
        offered, unknown = offered_devices(host, timeout=min(DEFAULT_TIMEOUT, timeout))
        still = wanted & offered
        if still and unknown is None:
            given = list_pod_devices(host, timeout=min(DEFAULT_TIMEOUT, timeout))
            still -= {a.device_id.lower() for a in given.assignments}
        if unknown is not None or not still:
            return []
        if clock() >= deadline or (cancelled is not None and cancelled()):
            return sorted(still)
        time.sleep(every)


def assigned_functions(host: HostRoot, inv: Inventory, naming: Naming,
                       assignments: Iterable[Assignment]) -> dict[str, list[Assignment]]:
    """BDF -> the pods given it: every PCI function of a passthrough unit whose device ID
    the kubelet handed out. Matched by ID alone: the plugin's ID is the unit's first BDF,
    and a BDF names one PCI function of this node whatever resource it was advertised
    under (an alias, another naming rule)."""
    by_id: dict[str, list[Assignment]] = {}
    for a in assignments:
        by_id.setdefault(a.device_id.lower(), []).append(a)
    out: dict[str, list[Assignment]] = {}
    for unit in resource_units(host, inv, naming):
        given = [a for key in (unit.id, *unit.functions) for a in by_id.get(key.lower(), [])]
        if given:
            for bdf in unit.functions:
                out[bdf] = list(dict.fromkeys(given))
    return out


def allocatable_of(host: HostRoot, resource: str, *, timeout: float = DEFAULT_TIMEOUT,
                   socket: str = POD_RESOURCES_SOCKET) -> frozenset[str] | None:
    """The device IDs of one resource the kubelet lists as allocatable now (healthy, given to a
    pod or not: ``GetAllocatableResources``); None when the kubelet could not be asked."""
    answer, _ = _ask(host, "GetAllocatableResources", timeout, socket)
    if answer is None:
        return None
    return frozenset(i.lower() for d in answer.devices if d.resource_name == resource for i in d.device_ids)
