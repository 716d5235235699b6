"""An NVML stand-in with the part of pynvml's API the container plugin uses.

No GPU (and no libnvidia-ml) exists on build machines. ``FakeNvml`` behaves
like the ``pynvml`` module for: ``nvmlInit``/``nvmlShutdown`` (reference
counted, calls before init fail with NVML_ERROR_UNINITIALIZED),
``nvmlDeviceGetCount``, ``nvmlDeviceGetHandleByIndex``, ``nvmlDeviceGetUUID``,
``nvmlDeviceGetPciInfo`` (``busId`` as bytes, NVML's 8-digit domain),
``nvmlEventSetCreate``/``nvmlEventSetFree``, ``nvmlDeviceRegisterEvents``,
``nvmlEventSetWait`` (blocks up to the timeout, then NVML_ERROR_TIMEOUT; an
event reaches only sets on which its device registered its type) and
``NVMLError`` carrying the real error codes. Tests drive it with
``xid(uuid, code)``; ``FakeNvml.missing()`` fails init like a node without
the library.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import deque
from dataclasses import dataclass, field

# The real values from nvml.h / pynvml.
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

nvmlEventTypeNone = 0x0
nvmlEventTypeSingleBitEccError = 0x1
nvmlEventTypeDoubleBitEccError = 0x2
nvmlEventTypePState = 0x4
nvmlEventTypeXidCriticalError = 0x8

_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    """Like pynvml's: ``.value`` is the NVML return code, ``str()`` its text."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML Error with code {self.value}")


@dataclass(frozen=True)
class FakeGpu:
    uuid: str
    bus_id: str  # as NVML prints it: 00000000:17:00.0
    name: str = "NVIDIA A10"
    xid_events: bool = True  # False: RegisterEvents says Not Supported


@dataclass
class _Handle:
    index: int


@dataclass
class _PciInfo:
    busId: bytes  # noqa: N815  (pynvml's field name)
    bus: int
    device: int
    domain: int


@dataclass
class _EventData:
    device: _Handle | None
    eventType: int  # noqa: N815
    eventData: int  # noqa: N815
    gpuInstanceId: int = 0xFFFFFFFF  # noqa: N815
    computeInstanceId: int = 0xFFFFFFFF  # noqa: N815


@dataclass
class _EventSet:
    number: int
    registered: dict[int, int] = field(default_factory=dict)  # gpu index -> event mask
    queue: deque = field(default_factory=deque)
    freed: bool = False


class FakeNvml:
    """A stand-in for the ``pynvml`` module; one instance per simulated node."""

    NVMLError = NVMLError
    NVML_ERROR_UNINITIALIZED = NVML_ERROR_UNINITIALIZED
    NVML_ERROR_INVALID_ARGUMENT = NVML_ERROR_INVALID_ARGUMENT
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_NOT_FOUND = NVML_ERROR_NOT_FOUND
    NVML_ERROR_DRIVER_NOT_LOADED = NVML_ERROR_DRIVER_NOT_LOADED
    NVML_ERROR_TIMEOUT = NVML_ERROR_TIMEOUT
    NVML_ERROR_LIBRARY_NOT_FOUND = NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_ERROR_GPU_IS_LOST = NVML_ERROR_GPU_IS_LOST
    NVML_ERROR_UNKNOWN = NVML_ERROR_UNKNOWN
    nvmlEventTypeNone = nvmlEventTypeNone
    nvmlEventTypeXidCriticalError = nvmlEventTypeXidCriticalError
    nvmlEventTypeDoubleBitEccError = nvmlEventTypeDoubleBitEccError

    def __init__(self, gpus: list[FakeGpu] | tuple[FakeGpu, ...] = (), *, init_error: int | None = None):
        self.gpus = list(gpus)
        self.init_error = init_error
        self.init_calls = 0
        self._refs = 0
        self._cond = threading.Condition()
        self._sets: dict[int, _EventSet] = {}
        self._numbers = itertools.count(1)

    @classmethod
    def for_simulated_host(cls, host) -> FakeNvml:
        """NVML on a simulated node: each ``nvmlInit`` lists the NVIDIA GPUs then bound to
        the ``nvidia`` driver in its sysfs (so the container plugin on the local node of
        hack/local-cluster follows the agent's give-back), with UUIDs made from their
        addresses; none bound is a driver that is not loaded."""
        return _SimulatedNvml(host)

    @classmethod
    def missing(cls) -> FakeNvml:
        """A node without libnvidia-ml: every nvmlInit fails as pynvml's does."""
        return cls(init_error=NVML_ERROR_LIBRARY_NOT_FOUND)

    # -- test controls ------------------------------------------------------------

    def xid(self, uuid: str | None, code: int) -> None:
        """Raise XID ``code`` on the GPU ``uuid`` (None: an event NVML cannot attribute)."""
        index = None if uuid is None else self._index_of(uuid)
        with self._cond:
            for event_set in self._sets.values():
                if event_set.freed:
                    continue
                if index is None or event_set.registered.get(index, 0) & nvmlEventTypeXidCriticalError:
                    handle = None if index is None else _Handle(index)
                    event_set.queue.append(_EventData(handle, nvmlEventTypeXidCriticalError, code))
            self._cond.notify_all()

    @property
    def initialised(self) -> bool:
        with self._cond:
            return self._refs > 0

    def _index_of(self, uuid: str) -> int:
        for index, gpu in enumerate(self.gpus):
            if gpu.uuid == uuid:
                return index
        raise KeyError(f"no fake GPU with UUID {uuid}")

    # -- pynvml API ----------------------------------------------------------------

    def nvmlInit(self) -> None:  # noqa: N802
        with self._cond:
            self.init_calls += 1
            if self.init_error is not None:
                raise NVMLError(self.init_error)
            self._refs += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        with self._cond:
            if self._refs == 0:
                raise NVMLError(NVML_ERROR_UNINITIALIZED)
            self._refs -= 1

    def _check(self) -> None:
        if self._refs == 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def _gpu(self, handle) -> FakeGpu:
        self._check()
        if not isinstance(handle, _Handle) or not 0 <= handle.index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[handle.index]

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:  # noqa: N802
        self._check()
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetUUID(self, handle) -> str:  # noqa: N802
        return self._gpu(handle).uuid

    def nvmlDeviceGetName(self, handle) -> str:  # noqa: N802
        return self._gpu(handle).name

    def nvmlDeviceGetPciInfo(self, handle) -> _PciInfo:  # noqa: N802
        gpu = self._gpu(handle)
        domain, bus, rest = gpu.bus_id.split(":")
        return _PciInfo(gpu.bus_id.encode(), int(bus, 16), int(rest.split(".")[0], 16), int(domain, 16))

    def nvmlEventSetCreate(self) -> _EventSet:  # noqa: N802
        with self._cond:
            self._check()
            event_set = _EventSet(next(self._numbers))
            self._sets[event_set.number] = event_set
            return event_set

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:  # noqa: N802
        with self._cond:
            if event_set.freed or event_set.number not in self._sets:
                raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
            event_set.freed = True
            del self._sets[event_set.number]
            self._cond.notify_all()

    def nvmlDeviceRegisterEvents(self, handle, event_types: int, event_set: _EventSet) -> None:  # noqa: N802
        gpu = self._gpu(handle)
        with self._cond:
            if event_set.freed:
                raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
            if not gpu.xid_events and event_types & nvmlEventTypeXidCriticalError:
                raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
            index = handle.index
            event_set.registered[index] = event_set.registered.get(index, 0) | event_types

    def nvmlEventSetWait(self, event_set: _EventSet, timeoutms: int) -> _EventData:  # noqa: N802
        with self._cond:
            self._check()
            if event_set.freed:
                raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
            ready = self._cond.wait_for(
                lambda: event_set.queue or event_set.freed, timeout=timeoutms / 1000.0
            )
            if not ready or not event_set.queue:
                raise NVMLError(NVML_ERROR_TIMEOUT)
            return event_set.queue.popleft()


class _SimulatedNvml(FakeNvml):
    def __init__(self, host) -> None:
        super().__init__()
        self.host = host

    def nvmlInit(self) -> None:  # noqa: N802
        from gpunode.host import pci

        with self._cond:
            if self._refs == 0:
                self.gpus = [
                    FakeGpu(uuid=f"GPU-{uuid.uuid5(uuid.NAMESPACE_OID, d.bdf)}",
                            bus_id=f"0000{d.bdf}".upper(), name="NVIDIA (simulated)")
                    for d in pci.scan(self.host)
                    if d.is_nvidia and d.is_gpu and d.driver == "nvidia"
                ]
                # No GPU on the driver: as on a node whose nvidia module is not loaded.
                self.init_error = None if self.gpus else NVML_ERROR_DRIVER_NOT_LOADED
        super().nvmlInit()
