"""What the simulated kubelet (``nodesim.kubelet``) knows, as tests read it: the
registrations it accepted and refused, the devices each plugin lists, the pods it
admitted and ended."""

from __future__ import annotations

from dataclasses import dataclass, field

from nodesim.podresources import ListedDevice, PodRecord


@dataclass(frozen=True)
class PluginOptions:
    """A plugin's DevicePluginOptions as the kubelet keeps them (from Register, then from
    GetDevicePluginOptions); until it has them, it asks for a preferred allocation."""

    get_preferred_allocation_available: bool = True
    pre_start_required: bool = False


class AdmissionError(Exception):
    """The simulated kubelet would not admit the pod (UnexpectedAdmissionError)."""


@dataclass(frozen=True)
class Registration:
    """One accepted Register call."""

    version: str
    endpoint: str
    resource_name: str
    options: PluginOptions
    at: float  # time.monotonic() when it arrived


HISTORY = 1000


@dataclass
class KubeletState:
    """What the simulated kubelet knows; tests read copies of it."""

    registrations: list[Registration] = field(default_factory=list)
    # (version, endpoint, resource_name, error message) of refused calls
    rejections: list[tuple[str, str, str, str]] = field(default_factory=list)
    # latest ListAndWatch list per resource (cleared for all by restart())
    devices: dict[str, list[ListedDevice]] = field(default_factory=dict)
    # how many ListAndWatch responses arrived per resource
    updates: dict[str, int] = field(default_factory=dict)
    # GetDevicePluginOptions answers per resource
    options: dict[str, PluginOptions] = field(default_factory=dict)
    # resources whose ListAndWatch stream is open right now
    connected: set[str] = field(default_factory=set)
    restarts: int = 0
    # admitted pods, in admission order (PodResources answers from these)
    pods: list[PodRecord] = field(default_factory=list)
    # pods a restart's re-admission ended, with the kubelet's reason ("OutOf<resource>")
    ended: list[tuple[PodRecord, str]] = field(default_factory=list)
    # every ListAndWatch update as it arrived: (monotonic time, resource, ((id, health), ...)),
    # and a plugin's disconnect as its devices all Unhealthy, the last HISTORY of them; the
    # kubelet acts on each, so a test may not miss a short one
    history: list[tuple[float, str, tuple[tuple[str, str], ...]]] = field(default_factory=list)

    def registrations_for(self, resource_name: str) -> list[Registration]:
        return [r for r in self.registrations if r.resource_name == resource_name]

    def healthy(self, resource_name: str) -> list[str]:
        return [d.id for d in self.devices.get(resource_name, []) if d.healthy]
