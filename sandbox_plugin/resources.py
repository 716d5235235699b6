"""What a device plugin resource is, independent of gRPC.

A resource (the VFIO passthrough GPUs of one model, the container GPUs from
NVML, a fixed list in tests) says which devices it has, hands out a container's
share of them, and announces changes. ``sandbox_plugin.server.PluginServer``
turns one resource into a kubelet device plugin; nothing here knows about
protobuf, so resources stay testable on their own.

Change announcements: a resource calls ``self.changes.notify()`` whenever its
device set or a device's health changes (the passthrough resource does so from
its inotify thread). Every ListAndWatch stream subscribes to those
notifications and sends a fresh ``devices()`` snapshot from the notifying
thread; ``watch`` offers the same as an iterator.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from gpunode.k8snames import QUALIFIED_NAME_MAX, is_extended_resource_name
from kubeletapi.deviceplugin_paths import KUBELET_SOCKET, socket_name_for

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
HEALTH_VALUES = (HEALTHY, UNHEALTHY)

# The kubelet refuses longer device IDs.
MAX_DEVICE_ID_LENGTH = 63



@dataclass(frozen=True)
class PluginDevice:
    """One device as advertised to the kubelet."""

    id: str
    health: str = HEALTHY
    numa_node: int | None = None

    def __post_init__(self) -> None:
        if self.health not in HEALTH_VALUES:
            raise ValueError(
                f"device {self.id!r} has health {self.health!r}; use {HEALTHY!r} or {UNHEALTHY!r}"
            )

    @property
    def healthy(self) -> bool:
        return self.health == HEALTHY


@dataclass(frozen=True)
class DeviceNode:
    """A device node the runtime makes available in the container."""

    container_path: str
    host_path: str  # where the runtime opens it (HostRoot.runtime_node), never prefixed by a HostRoot
    permissions: str = "rw"  # cgroup access: any of r, w, m


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool = True


@dataclass
class ContainerAllocation:
    """What one container gets for the devices it was given."""

    devices: list[DeviceNode] = field(default_factory=list)
    envs: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: list[str] = field(default_factory=list)  # fully qualified: vendor/class=name
    mounts: list[Mount] = field(default_factory=list)


@dataclass(frozen=True)
class PluginOptions:
    get_preferred_allocation_available: bool = True
    pre_start_required: bool = False


class AllocationError(Exception):
    """A device cannot be handed out (it is unhealthy, busy, ...)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UnknownDeviceError(AllocationError):
    """The request names a device this resource does not have."""


class ChangeNotifier:
    """A change counter that threads can wait on, and subscribe to.

    Notifications coalesce: a waiter learns "something changed since generation
    N", then reads the current state once, however many changes happened.
    A subscriber is called in the notifying thread, after the change: the
    server's ListAndWatch streams send from there, so a change reaches the
    kubelet without waiting for another thread to be scheduled.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._generation = 0
        self._subscribers: tuple[Callable[[], None], ...] = ()

    @property
    def generation(self) -> int:
        with self._cond:
            return self._generation

    def notify(self) -> None:
        with self._cond:
            self._generation += 1
            self._cond.notify_all()
            subscribers = self._subscribers
        # Outside the lock: a subscriber takes locks of its own (a stream's,
        # a connection's) that other threads hold while they subscribe.
        for subscriber in subscribers:
            try:
                subscriber()
            except Exception:  # one broken stream must not keep the change from the others
                log.exception("a change subscriber failed")

    def subscribe(self, subscriber: Callable[[], None]) -> Callable[[], None]:
        """Call ``subscriber()`` after every change; returns the call that ends that."""
        with self._cond:
            self._subscribers += (subscriber,)

        def unsubscribe() -> None:
            with self._cond:
                self._subscribers = tuple(s for s in self._subscribers if s is not subscriber)

        return unsubscribe

    def wake(self) -> None:
        """Wake waiters without a change, so they look at their stop events."""
        with self._cond:
            self._cond.notify_all()

    def wait(self, seen: int, stop: threading.Event, timeout: float | None = None) -> int:
        """Block until the generation differs from ``seen``, ``stop`` is set or
        ``timeout`` passes; return the current generation."""
        with self._cond:
            self._cond.wait_for(lambda: self._generation != seen or stop.is_set(), timeout)
            return self._generation


def validate_resource_name(resource_name: str) -> None:
    if not is_extended_resource_name(resource_name):
        raise ValueError(
            f"resource name {resource_name!r} is not a valid extended resource name; "
            f"use <domain>/<name> with a name of at most {QUALIFIED_NAME_MAX} letters, digits, "
            "'-', '_' or '.'"
        )


def validate_socket_name(socket_name: str) -> None:
    if (
        not socket_name
        or "/" in socket_name
        or socket_name in (".", "..", KUBELET_SOCKET)
        or socket_name.startswith(".")
    ):
        raise ValueError(
            f"socket name {socket_name!r} is not usable; use a plain file name "
            f"(no '/', not {KUBELET_SOCKET!r}) such as 'vendor-model.sock'"
        )


class Resource(ABC):
    """One extended resource served by one device plugin.

    Subclasses call ``super().__init__(...)``, implement ``devices`` and
    ``allocate``, and call ``self.changes.notify()`` when ``devices()`` would
    return something different.
    """

    def __init__(
        self,
        resource_name: str,
        socket_name: str | None = None,
        options: PluginOptions | None = None,
    ) -> None:
        validate_resource_name(resource_name)
        self.resource_name = resource_name
        self.socket_name = socket_name or socket_name_for(resource_name)
        validate_socket_name(self.socket_name)
        self.options = options or PluginOptions()
        self.changes = ChangeNotifier()

    @abstractmethod
    def devices(self) -> list[PluginDevice]:
        """The devices to advertise now (the server drops invalid IDs)."""

    @abstractmethod
    def allocate(self, device_ids: Sequence[str]) -> ContainerAllocation:
        """What a container given ``device_ids`` needs; raise AllocationError
        (UnknownDeviceError for an ID we do not have) naming the device."""

    def watch(self, stop: threading.Event) -> Iterator[list[PluginDevice]]:
        """Yield the device list now, then again after every change, until ``stop``.

        The timeout only bounds how long a forgotten stop can go unnoticed;
        whoever sets ``stop`` can call ``changes.wake()`` to end the wait at once.
        (The server's ListAndWatch uses ``changes.subscribe`` instead, to send
        from the notifying thread.)
        """
        seen = self.changes.generation
        yield self.devices()
        while not stop.is_set():
            current = self.changes.wait(seen, stop, timeout=1.0)
            if stop.is_set():
                return
            if current != seen:
                seen = current
                yield self.devices()

    def preferred(
        self, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        """Pick ``size`` IDs from ``available``, keeping ``must_include``.

        Default policy: stay on one NUMA node where possible (the node of the
        devices already required, else the node with the most available
        devices), then keep the kubelet's order.
        """
        chosen = list(dict.fromkeys(must_include))
        if size <= len(chosen):
            return chosen
        numa = {d.id: d.numa_node for d in self.devices()}
        candidates = [i for i in dict.fromkeys(available) if i not in chosen]
        if chosen:
            home = numa.get(chosen[0])
        else:
            counts = Counter(numa.get(i) for i in candidates)
            home = counts.most_common(1)[0][0] if counts else None
        # sorted() is stable: the kubelet's order survives within each group.
        candidates = sorted(candidates, key=lambda i: numa.get(i) != home)
        return chosen + candidates[: size - len(chosen)]


class StaticResource(Resource):
    """A fixed list of devices whose health and membership tests can change.

    Allocate answers with ``<env_var>=<id,id>``, a device node per device
    under ``/dev/static/`` and, given ``cdi_kind``, the CDI names ``kind=id``.
    """

    def __init__(
        self,
        resource_name: str,
        devices: Iterable[PluginDevice],
        *,
        socket_name: str | None = None,
        options: PluginOptions | None = None,
        env_var: str = "STATIC_DEVICES",
        cdi_kind: str | None = None,
    ) -> None:
        super().__init__(resource_name, socket_name, options)
        self._lock = threading.Lock()
        self._devices = list(devices)
        self.env_var = env_var
        self.cdi_kind = cdi_kind

    def devices(self) -> list[PluginDevice]:
        with self._lock:
            return list(self._devices)

    def set_devices(self, devices: Iterable[PluginDevice]) -> None:
        with self._lock:
            self._devices = list(devices)
        self.changes.notify()

    def set_health(self, device_id: str, health: str) -> None:
        with self._lock:
            for index, device in enumerate(self._devices):
                if device.id == device_id:
                    self._devices[index] = replace(device, health=health)
                    break
            else:
                raise KeyError(f"device {device_id!r} is not in {self.resource_name}")
        self.changes.notify()

    def allocate(self, device_ids: Sequence[str]) -> ContainerAllocation:
        by_id = {d.id: d for d in self.devices()}
        for device_id in device_ids:
            device = by_id.get(device_id)
            if device is None:
                raise UnknownDeviceError(
                    f"device {device_id!r} is not a {self.resource_name} device on this node"
                )
            if not device.healthy:
                raise AllocationError(
                    f"device {device_id!r} of {self.resource_name} is unhealthy; "
                    "wait for it to recover or pick another"
                )
        allocation = ContainerAllocation(
            devices=[DeviceNode(f"/dev/static/{i}", f"/dev/static/{i}") for i in device_ids],
            envs={self.env_var: ",".join(device_ids)},
        )
        if self.cdi_kind:
            allocation.cdi_devices = [f"{self.cdi_kind}={i}" for i in device_ids]
        return allocation
