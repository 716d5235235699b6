"""NVIDIA Fabric Manager through its SDK library (``libnvfm.so.1``), by ctypes.

On an NVSwitch board in NVIDIA's Shared NVSwitch model (Fabric Manager User Guide §4, §7), FM
runs on the host with the NVSwitches (``FABRIC_MODE=1``) and sets up the NVLink fabric of
one GPU partition at a time; CUDA in a VM starts only on GPUs whose partition is active.
The calls (guide §5): ``fmLibInit``, ``fmConnect``, ``fmGetSupportedFabricPartitions`` (§5.6),
``fmActivateFabricPartition`` (§5.7), ``fmDeactivateFabricPartition`` (§5.9),
``fmSetActivatedFabricPartitions`` (§5.10, after FM restarted with ``--restart``).

The structure layouts are the SDK's ``nv_fm_types.h`` as the guide's §5.1 gives them (our
copy of the facts: ``nodesim/fabricmanager/nvfm_sdk.h``); each versioned structure carries
``sizeof | version << 24``. Every call is bounded: ``fmConnect`` by its ``timeoutMs``, the
others by a deadline on a worker thread (the SDK has none), after which the connection is
dropped and the error says FM did not answer.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from gpunode.errors import GpuNodeError

DEFAULT_LIBRARY = "libnvfm.so.1"
DEFAULT_ADDRESS = "127.0.0.1:6666"  # FM's default: TCP on the loopback, FM_CMD_PORT_NUMBER
DEFAULT_TIMEOUT = 5.0

MAX_STR = 256
UUID_LEN = 80
BUS_ID_LEN = 32
MAX_GPUS = 16
MAX_PARTITIONS = 64

# fmReturn_t (nv_fm_types.h): the name, and what it means for us.
RETURNS: dict[int, tuple[str, str]] = {
    0: ("FM_ST_SUCCESS", "success"),
    -1: ("FM_ST_BADPARAM", "FM refused the request's arguments (a partition ID it does not support)"),
    -2: ("FM_ST_GENERIC_ERROR", "FM failed (its log and syslog say why)"),
    -3: ("FM_ST_NOT_SUPPORTED", "FM is not running in the Shared NVSwitch mode (set FABRIC_MODE=1 in its "
                                "config and restart it)"),
    -4: ("FM_ST_UNINITIALIZED", "the FM library was not initialised, or the partition is not active"),
    -5: ("FM_ST_TIMEOUT", "FM timed out configuring a GPU or NVSwitch"),
    -6: ("FM_ST_VERSION_MISMATCH", "the FM library and the running FM are different versions"),
    -7: ("FM_ST_IN_USE", "the partition is already active, or one of its GPUs is in another active partition"),
    -8: ("FM_ST_NOT_CONFIGURED", "FM is still initialising (or restarting and waiting for the active "
                                 "partitions)"),
    -9: ("FM_ST_CONNECTION_NOT_VALID", "FM cannot be reached (not running, or another address)"),
    -10: ("FM_ST_NVLINK_ERROR", "an NVLink error"),
    -11: ("FM_ST_RESOURCE_BAD", "a resource that does not exist"),
    -12: ("FM_ST_RESOURCE_IN_USE", "a resource already in use"),
    -13: ("FM_ST_RESOURCE_NOT_IN_USE", "a resource not in use"),
    -14: ("FM_ST_RESOURCE_EXHAUSTED", "a resource exhausted"),
    -15: ("FM_ST_RESOURCE_NOT_READY", "a resource not ready"),
    -16: ("FM_ST_PARTITION_EXISTS", "the partition exists"),
    -17: ("FM_ST_PARTITION_ID_IN_USE", "the partition ID is in use"),
    -18: ("FM_ST_PARTITION_ID_NOT_IN_USE", "no partition has that ID"),
    -19: ("FM_ST_PARTITION_NAME_IN_USE", "the partition name is in use"),
    -20: ("FM_ST_PARTITION_NAME_NOT_IN_USE", "no partition has that name"),
    -21: ("FM_ST_PARTITION_ID_NAME_MISMATCH", "the partition ID and name disagree"),
    -22: ("FM_ST_NOT_READY", "FM is not ready"),
}
SUCCESS, BADPARAM, NOT_SUPPORTED, UNINITIALIZED, TIMEOUT = 0, -1, -3, -4, -5
VERSION_MISMATCH, IN_USE, NOT_CONFIGURED, CONNECTION_NOT_VALID = -6, -7, -8, -9


class FabricManagerError(GpuNodeError):
    """An FM call that failed: ``code`` is its ``fmReturn_t`` (None: the library itself could
    not be loaded, or FM did not answer in time)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code

    @property
    def name(self) -> str:
        return return_name(self.code) if self.code is not None else "none"


def return_name(code: int) -> str:
    return RETURNS.get(code, (f"fmReturn_t {code}", ""))[0]


def _version(struct: type[ctypes.Structure], version: int) -> int:
    return ctypes.sizeof(struct) | (version << 24)


class ConnectParamsV1(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("addressInfo", ctypes.c_char * MAX_STR),
                ("timeoutMs", ctypes.c_uint), ("addressIsUnixSocket", ctypes.c_uint)]


class ConnectParamsV2(ctypes.Structure):
    _fields_ = [*ConnectParamsV1._fields_, ("addressType", ctypes.c_int)]


class PartitionGpuInfo(ctypes.Structure):
    _fields_ = [("physicalId", ctypes.c_uint), ("uuid", ctypes.c_char * UUID_LEN),
                ("pciBusId", ctypes.c_char * BUS_ID_LEN), ("numNvLinksAvailable", ctypes.c_uint),
                ("maxNumNvLinks", ctypes.c_uint), ("nvlinkLineRateMBps", ctypes.c_uint)]


class PartitionInfo(ctypes.Structure):
    _fields_ = [("partitionId", ctypes.c_uint), ("isActive", ctypes.c_uint), ("numGpus", ctypes.c_uint),
                ("gpuInfo", PartitionGpuInfo * MAX_GPUS)]


class PartitionList(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("numPartitions", ctypes.c_uint), ("maxNumPartitions", ctypes.c_uint),
                ("partitionInfo", PartitionInfo * MAX_PARTITIONS)]


class ActivatedList(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("numPartitions", ctypes.c_uint),
                ("partitionIds", ctypes.c_uint * MAX_PARTITIONS)]


@dataclass(frozen=True)
class FmGpu:
    """One GPU of a partition as FM reports it. On HGX H100 and later ``pci_bus_id`` and
    ``uuid`` are empty and ``physical_id`` is the GPU's module ID (guide §5.1, note)."""

    physical_id: int
    pci_bus_id: str
    uuid: str
    nvlinks: int
    max_nvlinks: int


@dataclass(frozen=True)
class FmPartition:
    partition_id: int
    active: bool
    gpus: tuple[FmGpu, ...]


T = TypeVar("T")


class FabricManager:
    """One connection to FM; ``with FabricManager.connect(...) as fm:``. Calls are serialised
    (the SDK handle is not shared between threads)."""

    def __init__(self, lib: ctypes.CDLL, handle: ctypes.c_void_p, address: str, timeout: float) -> None:
        self._lib = lib
        self._handle = handle
        self.address = address
        self.timeout = timeout
        self._lock = threading.Lock()
        self._broken: str | None = None

    @classmethod
    def connect(cls, address: str = DEFAULT_ADDRESS, *, library: str = DEFAULT_LIBRARY,
                unix_socket: bool | None = None, timeout: float = DEFAULT_TIMEOUT) -> FabricManager:
        """Connected to FM at ``address``: ``host[:port]``, or a unix socket's path (one that
        starts with ``/``, FM's ``FM_CMD_UNIX_SOCKET_PATH``)."""
        lib = load(library)
        if unix_socket is None:
            unix_socket = address.startswith("/")
        raw = address.encode()
        if not raw or len(raw) >= MAX_STR:
            raise FabricManagerError(f"Fabric Manager address {address!r} must be 1 to {MAX_STR - 1} bytes")
        code = _bounded(lambda: lib.fmLibInit(), timeout, "fmLibInit", address)
        if code not in (SUCCESS, IN_USE):  # IN_USE: this process initialised it already
            raise _error("fmLibInit", code, address)
        handle = ctypes.c_void_p()
        # The newest layout first; an SDK that predates it answers VERSION_MISMATCH.
        for params in (ConnectParamsV2(version=_version(ConnectParamsV2, 2), addressType=2 if unix_socket else 1),
                       ConnectParamsV1(version=_version(ConnectParamsV1, 1))):
            params.addressInfo = raw
            params.timeoutMs = max(1, int(timeout * 1000))
            params.addressIsUnixSocket = 1 if unix_socket else 0
            code = _bounded(lambda p=params: lib.fmConnect(ctypes.byref(p), ctypes.byref(handle)),
                            timeout + 1.0, "fmConnect", address)
            if code != VERSION_MISMATCH:
                break
        if code != SUCCESS:
            raise _error("fmConnect", code, address)
        return cls(lib, handle, address, timeout)

    def __enter__(self) -> FabricManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._handle and self._broken is None:
                self._lib.fmDisconnect(self._handle)
            self._handle = ctypes.c_void_p()

    def partitions(self) -> list[FmPartition]:
        """The partitions FM supports, each with its GPUs and whether it is active (§5.6)."""
        found = PartitionList(version=_version(PartitionList, 1))
        self._call("fmGetSupportedFabricPartitions", lambda h: self._lib.fmGetSupportedFabricPartitions(
            h, ctypes.byref(found)))
        return [_partition(found.partitionInfo[i]) for i in range(min(found.numPartitions, MAX_PARTITIONS))]

    def activate(self, partition_id: int) -> None:
        """The partition's NVLink fabric set up, before its VM starts (§5.7)."""
        self._call("fmActivateFabricPartition", lambda h: self._lib.fmActivateFabricPartition(
            h, ctypes.c_uint(partition_id)), partition_id)

    def deactivate(self, partition_id: int) -> None:
        """The partition's fabric taken down, once its VM has ended (§5.9)."""
        self._call("fmDeactivateFabricPartition", lambda h: self._lib.fmDeactivateFabricPartition(
            h, ctypes.c_uint(partition_id)), partition_id)

    def set_activated(self, partition_ids: Iterable[int]) -> None:
        """FM told, after its restart, which partitions are still active (§5.10); an empty
        list is a valid answer FM waits for too."""
        ids = sorted(set(partition_ids))
        if len(ids) > MAX_PARTITIONS:
            raise FabricManagerError(f"{len(ids)} active partitions is more than FM's {MAX_PARTITIONS}")
        listed = ActivatedList(version=_version(ActivatedList, 1), numPartitions=len(ids))
        for i, pid in enumerate(ids):
            listed.partitionIds[i] = pid
        self._call("fmSetActivatedFabricPartitions", lambda h: self._lib.fmSetActivatedFabricPartitions(
            h, ctypes.byref(listed)))

    def _call(self, what: str, call: Callable[[ctypes.c_void_p], int], partition: int | None = None) -> None:
        with self._lock:
            if self._broken is not None:
                raise FabricManagerError(self._broken, TIMEOUT)
            try:
                code = _bounded(lambda: call(self._handle), self.timeout, what, self.address)
            except FabricManagerError as e:
                self._broken = str(e)  # a call may still be running on the handle: never reuse it
                raise
        if code != SUCCESS:
            raise _error(what, code, self.address, partition)


_libraries: dict[str, ctypes.CDLL] = {}
_load_lock = threading.Lock()


def load(library: str) -> ctypes.CDLL:
    """The SDK library (a soname the dynamic linker finds, or a path), its calls typed."""
    with _load_lock:
        if library in _libraries:
            return _libraries[library]
        try:
            lib = ctypes.CDLL(library)
        except OSError as e:
            raise FabricManagerError(f"the Fabric Manager library {library} cannot be loaded ({e}); install "
                                     "NVIDIA's Fabric Manager development package (nvidia-fabricmanager-dev) or point "
                                     "devices.fabricManager.library at it") from None
        for name, args in (("fmLibInit", []), ("fmLibShutdown", []),
                           ("fmConnect", [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]),
                           ("fmDisconnect", [ctypes.c_void_p]),
                           ("fmGetSupportedFabricPartitions", [ctypes.c_void_p, ctypes.POINTER(PartitionList)]),
                           ("fmActivateFabricPartition", [ctypes.c_void_p, ctypes.c_uint]),
                           ("fmDeactivateFabricPartition", [ctypes.c_void_p, ctypes.c_uint]),
                           ("fmSetActivatedFabricPartitions", [ctypes.c_void_p, ctypes.POINTER(ActivatedList)])):
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise FabricManagerError(f"the Fabric Manager library {library} has no {name}: "
                                         "it is not NVIDIA's libnvfm") from None
            fn.restype = ctypes.c_int
            fn.argtypes = args
        _libraries[library] = lib
        return lib


def _bounded(call: Callable[[], T], timeout: float, what: str, address: str) -> T:
    """``call()`` on a worker thread, given up after ``timeout`` seconds."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, call()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box.append((False, e))

    worker = threading.Thread(target=run, name=f"fm-{what}", daemon=True)
    worker.start()
    worker.join(timeout)
    if not box:
        raise FabricManagerError(f"Fabric Manager at {address} did not answer {what} within {timeout:g} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _error(what: str, code: int, address: str, partition: int | None = None) -> FabricManagerError:
    name, meaning = RETURNS.get(code, (f"fmReturn_t {code}", "an answer this SDK version does not list"))
    about = f" for partition {partition}" if partition is not None else ""
    return FabricManagerError(f"{what}{about} at {address} failed with {name}: {meaning}", code)


def _partition(info: PartitionInfo) -> FmPartition:
    gpus = tuple(FmGpu(g.physicalId, g.pciBusId.decode(errors="replace"), g.uuid.decode(errors="replace"),
                       g.numNvLinksAvailable, g.maxNumNvLinks)
                 for g in info.gpuInfo[:min(info.numGpus, MAX_GPUS)])
    return FmPartition(int(info.partitionId), bool(info.isActive), gpus)
