"""One generic kubelet device plugin server, used by every resource.

``PluginServer(resource, host_root)`` serves the v1beta1 DevicePlugin service on
``/var/lib/kubelet/device-plugins/<socket_name>`` and registers it on
``kubelet.sock`` in the same dir. A supervisor thread keeps it that way: when
the kubelet restarts it deletes every socket there and creates a new
``kubelet.sock``, so we watch the dir with inotify and, on any change to our
socket or to the kubelet's, check whether ours is gone or the kubelet's was
replaced, then serve and register again. Decisions are made from the files'
state, not from individual events, so missed or coalesced events do no harm
and a slow periodic check covers a lost inotify watch. Failed registrations
are retried with capped exponential backoff, and cut short as soon as a new
``kubelet.sock`` appears.

Several resources run in one process as several PluginServer objects; each has
its own gRPC server (one thread, ``grpcwire``) and supervisor thread.

The calls are answered from what the resource already holds: Allocate's answer
for a set of device IDs is encoded once and reused while the resource hands out
the very same allocation (it does so until its devices or the CDI specs change),
and ListAndWatch sends from the thread that announced the change, the moment it
is announced, rather than from a thread that has to be woken first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from pathlib import Path

from google.protobuf.message import DecodeError
from inotify_simple import flags as inotify_flags

from grpcwire.client import unary_call
from grpcwire.connection import ServerStream
from grpcwire.limits import shorten
from grpcwire.status import RpcError, StatusCode
from katamgr.host.root import HostRoot
from katamgr.node.backoff import Backoff
from katamgr.node.watching import Watcher
from kubeletapi import deviceplugin_pb2 as pb
from kubeletapi.deviceplugin_paths import API_VERSION, DEVICE_PLUGIN_DIR, KUBELET_SOCKET
from sandbox_plugin.metrics import PluginMetrics
from sandbox_plugin.resources import (
    MAX_DEVICE_ID_LENGTH,
    AllocationError,
    ContainerAllocation,
    PluginDevice,
    Resource,
    UnknownDeviceError,
)
from sandbox_plugin.served import FileId, PluginServerError, ServedSocket

log = logging.getLogger(__name__)

_SERVICE = "/v1beta1.DevicePlugin/"
_REGISTER = "/v1beta1.Registration/Register"
# Allocate answers kept per set of device IDs; a node has at most a few dozen
# devices per resource, so this only bounds what odd requests can leave behind.
_ANSWER_CACHE_SIZE = 512


def to_proto_devices(devices: list[PluginDevice], resource_name: str, warned: set[str]):
    """The advertisable devices as protobuf, dropping (and logging once) bad IDs."""
    out = []
    seen: set[str] = set()
    for device in devices:
        problem = None
        if not device.id:
            problem = "is empty"
        elif len(device.id) > MAX_DEVICE_ID_LENGTH:
            problem = f"is {len(device.id)} characters, over the kubelet's {MAX_DEVICE_ID_LENGTH}"
        elif device.id in seen:
            problem = "is listed twice"
        if problem:
            if device.id not in warned:
                warned.add(device.id)
                log.warning(
                    "%s: not advertising device ID %r: it %s", resource_name, device.id, problem
                )
            continue
        seen.add(device.id)
        message = pb.Device(ID=device.id, health=device.health)
        if device.numa_node is not None:
            message.topology.nodes.add(ID=device.numa_node)
        out.append(message)
    return out


def to_proto_allocation(allocation: ContainerAllocation) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(
        envs=allocation.envs,
        annotations=allocation.annotations,
        devices=[
            pb.DeviceSpec(
                container_path=d.container_path, host_path=d.host_path, permissions=d.permissions
            )
            for d in allocation.devices
        ],
        mounts=[
            pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
            for m in allocation.mounts
        ],
        cdi_devices=[pb.CDIDevice(name=name) for name in allocation.cdi_devices],
    )


def _length_delimited(field: int, payload: bytes) -> bytes:
    """One protobuf length-delimited field: how AllocateResponse holds each container's answer."""
    size = len(payload)
    out = bytearray([(field << 3) | 2])
    while size >= 0x80:
        out.append((size & 0x7F) | 0x80)
        size >>= 7
    out.append(size)
    return bytes(out) + payload


class _ListAndWatch:
    """One ListAndWatch call: the device list now, then again whenever it changes."""

    def __init__(self, servicer: _DevicePluginServicer, stream: ServerStream) -> None:
        self.servicer = servicer
        self.stream = stream
        # Holds the read of the devices and the send together, so two changes
        # announced at once by two threads reach the kubelet in order.
        self._lock = threading.Lock()
        self._last: bytes | None = None

    def start(self) -> None:
        unsubscribe = self.servicer.resource.changes.subscribe(self.push)
        self.stream.on_close(unsubscribe)
        self.push()

    def push(self) -> None:
        resource = self.servicer.resource
        with self._lock:
            if self.stream.closed:
                return
            answer = self.servicer.device_list(tuple(resource.devices()))
            if answer == self._last:
                return
            self._last = answer
            self.stream.send(answer)


class _DevicePluginServicer:
    """The DevicePlugin calls, bytes in and bytes out (``grpcwire``)."""

    def __init__(self, resource: Resource, metrics: PluginMetrics | None = None) -> None:
        self.resource = resource
        self.metrics = metrics
        self.warned: set[str] = set()
        # device IDs -> (the allocation the resource gave, its encoded answer)
        self._answers: dict[tuple[str, ...], tuple[ContainerAllocation, bytes]] = {}
        # request -> its containers' device IDs, checked (the kubelet asks the same again)
        self._requests: dict[bytes, list[tuple[str, ...]]] = {}
        # device list -> encoded ListAndWatchResponse, shared by the streams (a kubelet
        # restart leaves two open for a moment) and by a list that comes back
        self._lists: dict[tuple[PluginDevice, ...], bytes] = {}
        self._lists_lock = threading.Lock()
        options = resource.options
        self._options = pb.DevicePluginOptions(
            pre_start_required=options.pre_start_required,
            get_preferred_allocation_available=options.get_preferred_allocation_available,
        ).SerializeToString()
        if metrics is not None:
            name = resource.resource_name
            self._allocate_seconds = metrics.allocate_seconds.labels(name)

    def unary(self) -> dict:
        return {
            _SERVICE + "GetDevicePluginOptions": lambda request: self._options,
            _SERVICE + "GetPreferredAllocation": self.get_preferred_allocation,
            _SERVICE + "Allocate": self.allocate,
            _SERVICE + "PreStartContainer": lambda request: b"",
        }

    def streaming(self) -> dict:
        return {_SERVICE + "ListAndWatch": self.list_and_watch}

    def list_and_watch(self, request: bytes, stream: ServerStream) -> None:
        _ListAndWatch(self, stream).start()

    def device_list(self, devices: tuple[PluginDevice, ...]) -> bytes:
        """The encoded ListAndWatch answer for ``devices``."""
        with self._lists_lock:
            answer = self._lists.get(devices)
            if answer is None:
                name = self.resource.resource_name
                advertised = to_proto_devices(list(devices), name, self.warned)
                log.debug("%s: ListAndWatch sends %d devices", name, len(advertised))
                answer = pb.ListAndWatchResponse(devices=advertised).SerializeToString()
                if len(self._lists) >= 64:
                    self._lists.clear()
                self._lists[devices] = answer
            return answer

    def get_preferred_allocation(self, request: bytes) -> bytes:
        if self.metrics is None:
            return self._preferred(request)
        self.metrics.preferred_allocations.labels(self.resource.resource_name).inc()
        started = time.perf_counter()
        try:
            return self._preferred(request)
        finally:
            self.metrics.preferred_seconds.labels(self.resource.resource_name).observe(
                time.perf_counter() - started)

    def _preferred(self, request: bytes) -> bytes:
        response = pb.PreferredAllocationResponse()
        for req in _parse(pb.PreferredAllocationRequest, request).container_requests:
            try:
                ids = self.resource.preferred(
                    list(req.available_deviceIDs),
                    list(req.must_include_deviceIDs),
                    req.allocation_size,
                )
            except AllocationError as exc:
                raise RpcError(StatusCode.INVALID_ARGUMENT, exc.message) from None
            response.container_responses.add(deviceIDs=ids)
        return response.SerializeToString()

    def allocate(self, request: bytes) -> bytes:
        if self.metrics is None:
            return self._allocate(request)
        started = time.perf_counter()
        try:
            return self._allocate(request)
        except RpcError as exc:
            self.metrics.allocate_errors.labels(self.resource.resource_name, exc.code.name).inc()
            raise
        except Exception:
            self.metrics.allocate_errors.labels(self.resource.resource_name, "UNKNOWN").inc()
            raise
        finally:
            self._allocate_seconds.observe(time.perf_counter() - started)

    def _allocate(self, request: bytes) -> bytes:
        containers = self._requests.get(request)
        if containers is None:
            name = self.resource.resource_name
            containers = [tuple(r.devices_ids) for r in _parse(pb.AllocateRequest, request).container_requests]
            problem = request_problem(containers)
            if problem:
                log.warning("%s: refused Allocate: %s", name, shorten(problem))
                raise RpcError(StatusCode.INVALID_ARGUMENT, f"{name}: {problem}")
            if len(self._requests) >= _ANSWER_CACHE_SIZE:
                self._requests.clear()
            self._requests[request] = containers
        return b"".join([self._container_answer(ids) for ids in containers])

    def _container_answer(self, ids: tuple[str, ...]) -> bytes:
        try:
            allocation = self.resource.allocate(ids)
        except UnknownDeviceError as exc:
            log.warning("%s: refused Allocate of %s: %s", self.resource.resource_name,
                        shorten(repr(list(ids))), shorten(exc.message))
            raise RpcError(StatusCode.INVALID_ARGUMENT, exc.message) from None
        except AllocationError as exc:
            log.warning("%s: refused Allocate of %s: %s", self.resource.resource_name,
                        shorten(repr(list(ids))), shorten(exc.message))
            raise RpcError(StatusCode.FAILED_PRECONDITION, exc.message) from None
        cached = self._answers.get(ids)
        if cached is not None and cached[0] is allocation:
            return cached[1]
        answer = _length_delimited(1, to_proto_allocation(allocation).SerializeToString())
        if len(self._answers) >= _ANSWER_CACHE_SIZE:
            self._answers.clear()
        self._answers[ids] = (allocation, answer)
        return answer


def _parse(message_type, request: bytes):
    try:
        return message_type.FromString(request)
    except DecodeError as exc:
        raise RpcError(StatusCode.INVALID_ARGUMENT, f"the request does not parse: {exc}") from None


def request_problem(containers: list[tuple[str, ...]] | list[list[str]]) -> str:
    """Why an Allocate request is malformed ("" when it is not).

    The kubelet asks for at least one device per container and never names a
    device twice; a request that does is a caller's bug, refused before any
    device is looked at rather than answered with fewer devices than asked.
    """
    if not containers:
        return "the request names no container"
    for index, ids in enumerate(containers):
        if not ids:
            return f"container request {index} names no device"
        repeated = sorted(i for i, n in Counter(ids).items() if n > 1)
        if repeated:
            return f"container request {index} names {', '.join(repeated)} more than once"
    return ""


class _DirWatcher:
    """inotify on the device-plugins dir; ``wake()`` (from stop()) cuts a wait short."""

    MASK = (
        inotify_flags.CREATE
        | inotify_flags.DELETE
        | inotify_flags.MOVED_FROM
        | inotify_flags.MOVED_TO
        | inotify_flags.DELETE_SELF
        | inotify_flags.MOVE_SELF
    )

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._watcher = Watcher()
        self._watch()

    def _watch(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._watcher.add_watch(self.directory, self.MASK)

    def wait(self, timeout: float, names: frozenset[str]) -> bool:
        """Wait up to ``timeout`` s for an event on one of ``names`` (or on the dir
        itself); return True when one came, False on timeout or wake()."""
        remaining = timeout
        deadline = time.monotonic() + timeout
        while remaining > 0:
            events = self._watcher.wait(remaining)
            if events is None:  # wake()
                return False
            relevant = False
            for event in events:
                if event.mask & (inotify_flags.DELETE_SELF | inotify_flags.MOVE_SELF):
                    log.warning("%s was removed or moved; watching it afresh", self.directory)
                    self._watch()
                    relevant = True
                elif event.name in names:
                    relevant = True
            if relevant:
                return True
            remaining = deadline - time.monotonic()
        return False

    def wake(self) -> None:
        self._watcher.wake()

    def close(self) -> None:
        self._watcher.close()


class PluginServer:
    """Serve one resource to the kubelet and keep it registered until stop()."""

    def __init__(
        self,
        resource: Resource,
        host_root: HostRoot | None = None,
        *,
        backoff: Backoff | None = None,
        register_timeout: float = 5.0,
        recheck_interval: float = 5.0,
        metrics: PluginMetrics | None = None,
    ) -> None:
        self.resource = resource
        self.metrics = metrics
        self.host_root = host_root or HostRoot()
        self.backoff = backoff or Backoff()
        self.register_timeout = register_timeout
        self.recheck_interval = recheck_interval
        self.socket_dir = self.host_root.path(DEVICE_PLUGIN_DIR)
        self.socket_path = self.socket_dir / resource.socket_name
        self.kubelet_socket = self.socket_dir / KUBELET_SOCKET
        self.registrations = 0  # successful Register calls so far
        self._servicer = _DevicePluginServicer(resource, metrics)
        self._socket = ServedSocket(
            self.socket_path, self._servicer.unary(), self._servicer.streaming(),
            name=f"dp-{resource.socket_name}", fix="use a shorter host root or socket name",
            on_failure=self._loop_died)
        self._stopping = threading.Event()
        self._registered = threading.Event()
        self._thread: threading.Thread | None = None
        self._watcher: _DirWatcher | None = None

    # -- public ---------------------------------------------------------------

    def start(self) -> None:
        """Start serving and registering in the background; returns at once."""
        if self._thread is not None:
            raise PluginServerError(
                f"plugin server for {self.resource.resource_name} already started"
            )
        self._watcher = _DirWatcher(self.socket_dir)
        self._thread = threading.Thread(
            target=self._supervise, name=f"plugin-{self.resource.resource_name}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving, end ListAndWatch streams and remove our socket."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.wake()
        if self._thread is not None:
            self._thread.join(timeout)
        self._socket.stop()
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        log.info("%s: device plugin stopped", self.resource.resource_name)

    def wait_registered(self, timeout: float | None = None) -> bool:
        """Block until registered with the current kubelet; False on timeout."""
        return self._registered.wait(timeout)

    @property
    def registered(self) -> bool:
        return self._registered.is_set()

    @property
    def trouble(self) -> str:
        """Why this plugin cannot be trusted to serve ("" when it can): /healthz's answer."""
        if self._thread is None or not self._thread.is_alive():
            return "its supervisor stopped"
        if not self._socket.healthy:
            return "its gRPC loop keeps dying (restart the process)"
        return ""

    def _loop_died(self) -> None:
        # From the dead loop's thread: the supervisor serves again at once.
        if self._watcher is not None:
            self._watcher.wake()

    def __enter__(self) -> PluginServer:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # -- supervisor -------------------------------------------------------------

    def _supervise(self) -> None:
        name = self.resource.resource_name
        watcher = self._watcher
        assert watcher is not None
        delays = self.backoff.delays()
        while not self._stopping.is_set():
            try:
                if self._socket.serve():
                    log.debug("%s: serving DevicePlugin on %s", name, self.socket_path)
                kubelet_id = self._register()
            except (RpcError, OSError, RuntimeError, PluginServerError) as exc:
                if self.metrics is not None:
                    self.metrics.registration_failures.labels(name).inc()
                delay = next(delays)
                log.warning(
                    "%s: could not register with the kubelet at %s (%s); retrying in %.1f s",
                    name,
                    self.kubelet_socket,
                    _describe(exc),
                    delay,
                )
                watcher.wait(delay, frozenset({KUBELET_SOCKET}))
                continue
            except Exception:  # a bug must not end the plugin for good
                delay = next(delays)
                log.exception("%s: unexpected error while serving; retrying in %.1f s", name, delay)
                watcher.wait(delay, frozenset({KUBELET_SOCKET}))
                continue
            delays = self.backoff.delays()
            self.registrations += 1
            if self.metrics is not None:
                self.metrics.registrations.labels(name).inc()
            self._registered.set()
            log.info(
                "%s: registered with the kubelet, serving on %s",
                name,
                self.host_root.host_path(self.socket_path),
            )
            watched = frozenset({KUBELET_SOCKET, self.resource.socket_name})
            while not self._stopping.is_set():
                watcher.wait(self.recheck_interval, watched)
                if not self._socket.intact:
                    log.info("%s: our socket was removed (kubelet restart?) or is not served; "
                             "serving again", name)
                    break
                if FileId.of(self.kubelet_socket) != kubelet_id:
                    log.info(
                        "%s: kubelet.sock was replaced (kubelet restart); registering again", name
                    )
                    break
            self._registered.clear()
        self._registered.clear()

    def _register(self) -> FileId:
        """Register with the kubelet; return the identity of the kubelet.sock used."""
        options = self.resource.options
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=self.resource.socket_name,
            resource_name=self.resource.resource_name,
            options=pb.DevicePluginOptions(
                pre_start_required=options.pre_start_required,
                get_preferred_allocation_available=options.get_preferred_allocation_available,
            ),
        )
        kubelet_id = FileId.of(self.kubelet_socket)
        if kubelet_id is None:
            raise FileNotFoundError("kubelet.sock does not exist (is the kubelet running?)")
        unary_call(str(self.kubelet_socket), _REGISTER, request.SerializeToString(), self.register_timeout)
        return kubelet_id


def _describe(exc: BaseException) -> str:
    if isinstance(exc, RpcError):
        return f"{exc.code.name}: {exc.details}"
    return str(exc)

