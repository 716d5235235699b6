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
its own gRPC server (threads) and supervisor thread.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from inotify_simple import flags as inotify_flags

from katamgr.host.root import HostRoot
from katamgr.host.watching import Watcher
from kubeletapi import deviceplugin_pb2 as pb
from kubeletapi import deviceplugin_pb2_grpc as pb_grpc
from sandbox_plugin.metrics import PluginMetrics
from sandbox_plugin.resources import (
    KUBELET_SOCKET,
    MAX_DEVICE_ID_LENGTH,
    AllocationError,
    ContainerAllocation,
    PluginDevice,
    Resource,
    UnknownDeviceError,
)

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


class PluginServerError(Exception):
    """The plugin cannot serve at all (not a transient kubelet problem)."""


@dataclass(frozen=True)
class Backoff:
    """Capped exponential backoff for registration retries."""

    initial: float = 0.5
    factor: float = 2.0
    cap: float = 30.0

    def delays(self) -> Iterator[float]:
        delay = self.initial
        while True:
            yield delay
            delay = min(delay * self.factor, self.cap)


@dataclass(frozen=True)
class _FileId:
    """Identity of a file, to tell 'the same socket' from 'a new one at the same path'."""

    dev: int
    ino: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> _FileId | None:
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        return cls(st.st_dev, st.st_ino, st.st_ctime_ns)


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


class _DevicePluginServicer(pb_grpc.DevicePluginServicer):
    def __init__(self, resource: Resource, metrics: PluginMetrics | None = None) -> None:
        self.resource = resource
        self.metrics = metrics
        self._warned: set[str] = set()
        self._streams: set[threading.Event] = set()
        self._lock = threading.Lock()

    def end_streams(self) -> None:
        with self._lock:
            for stop in self._streams:
                stop.set()
        self.resource.changes.wake()

    def GetDevicePluginOptions(self, request, context):
        options = self.resource.options
        return pb.DevicePluginOptions(
            pre_start_required=options.pre_start_required,
            get_preferred_allocation_available=options.get_preferred_allocation_available,
        )

    def ListAndWatch(self, request, context):
        stop = threading.Event()
        with self._lock:
            self._streams.add(stop)

        def on_end() -> None:
            stop.set()
            self.resource.changes.wake()

        context.add_callback(on_end)
        name = self.resource.resource_name
        last = None
        try:
            for devices in self.resource.watch(stop):
                advertised = to_proto_devices(devices, name, self._warned)
                if advertised == last:
                    continue
                last = advertised
                log.debug("%s: ListAndWatch sends %d devices", name, len(advertised))
                yield pb.ListAndWatchResponse(devices=advertised)
        finally:
            with self._lock:
                self._streams.discard(stop)

    def GetPreferredAllocation(self, request, context):
        response = pb.PreferredAllocationResponse()
        for req in request.container_requests:
            try:
                ids = self.resource.preferred(
                    list(req.available_deviceIDs),
                    list(req.must_include_deviceIDs),
                    req.allocation_size,
                )
            except AllocationError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
            response.container_responses.add(deviceIDs=ids)
        return response

    def Allocate(self, request, context):
        if self.metrics is None:
            return self._allocate(request, context)
        name = self.resource.resource_name
        started = time.perf_counter()
        try:
            return self._allocate(request, context)
        except Exception:
            code = context.code() if hasattr(context, "code") else None
            self.metrics.allocate_errors.labels(name, getattr(code, "name", None) or "UNKNOWN").inc()
            raise
        finally:
            self.metrics.allocate_seconds.labels(name).observe(time.perf_counter() - started)

    def _allocate(self, request, context):
        response = pb.AllocateResponse()
        name = self.resource.resource_name
        problem = request_problem([list(r.devices_ids) for r in request.container_requests])
        if problem:
            log.warning("%s: refused Allocate: %s", name, problem)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {problem}")
        for req in request.container_requests:
            ids = list(req.devices_ids)
            try:
                allocation = self.resource.allocate(ids)
            except UnknownDeviceError as exc:
                log.warning("%s: refused Allocate of %s: %s", name, ids, exc.message)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
            except AllocationError as exc:
                log.warning("%s: refused Allocate of %s: %s", name, ids, exc.message)
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, exc.message)
            response.container_responses.append(to_proto_allocation(allocation))
        return response

    def PreStartContainer(self, request, context):
        return pb.PreStartContainerResponse()


def request_problem(containers: list[list[str]]) -> str:
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
        repeated = sorted({i for i in ids if ids.count(i) > 1})
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
        max_workers: int = 6,
        register_timeout: float = 5.0,
        recheck_interval: float = 5.0,
        metrics: PluginMetrics | None = None,
    ) -> None:
        self.resource = resource
        self.metrics = metrics
        self.host_root = host_root or HostRoot()
        self.backoff = backoff or Backoff()
        # Every worker beyond what the GIL can run at once only adds switching:
        # with 100 concurrent Allocate callers, 4 workers gave about half the
        # p99 of 16 (bench/bench_plugin.py). Each open ListAndWatch stream holds one
        # worker (one per kubelet, two while a re-registration replaces it), so
        # 6 leaves 4 for unary calls.
        self.max_workers = max_workers
        self.register_timeout = register_timeout
        self.recheck_interval = recheck_interval
        self.socket_dir = self.host_root.path(DEVICE_PLUGIN_DIR)
        self.socket_path = self.socket_dir / resource.socket_name
        self.kubelet_socket = self.socket_dir / KUBELET_SOCKET
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH:
            raise PluginServerError(
                f"socket path {self.socket_path} is longer than the {MAX_SOCKET_PATH} bytes a "
                "unix socket allows; use a shorter host root or socket name"
            )
        self.registrations = 0  # successful Register calls so far
        self._servicer = _DevicePluginServicer(resource, metrics)
        self._grpc: grpc.Server | None = None
        self._socket_id: _FileId | None = None
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
        self._stop_grpc()
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
    def alive(self) -> bool:
        """The supervisor (registering, re-registering) is running."""
        return self._thread is not None and self._thread.is_alive()

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
                if not self._socket_intact():
                    self._start_grpc()
                kubelet_id = self._register()
            except (grpc.RpcError, OSError, RuntimeError, PluginServerError) as exc:
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
                if not self._socket_intact():
                    log.info("%s: our socket was removed (kubelet restart?); serving again", name)
                    break
                if _FileId.of(self.kubelet_socket) != kubelet_id:
                    log.info(
                        "%s: kubelet.sock was replaced (kubelet restart); registering again", name
                    )
                    break
            self._registered.clear()
        self._registered.clear()

    def _socket_intact(self) -> bool:
        current = _FileId.of(self.socket_path)
        return self._grpc is not None and current is not None and current == self._socket_id

    def _start_grpc(self) -> None:
        self._stop_grpc()
        _remove_socket(self.socket_path)  # a stale one from an earlier run
        server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=self.max_workers, thread_name_prefix=f"dp-{self.resource.socket_name}"
            )
        )
        pb_grpc.add_DevicePluginServicer_to_server(self._servicer, server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self._grpc = server
        self._socket_id = _FileId.of(self.socket_path)
        log.debug("%s: serving DevicePlugin on %s", self.resource.resource_name, self.socket_path)

    def _stop_grpc(self) -> None:
        server, self._grpc = self._grpc, None
        if server is None:
            return
        self._servicer.end_streams()
        server.stop(grace=0.2).wait(2.0)
        # Only remove the socket we created, never a newer file at the same path.
        if self._socket_id is not None and _FileId.of(self.socket_path) == self._socket_id:
            _remove_socket(self.socket_path)
        self._socket_id = None

    def _register(self) -> _FileId:
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
        kubelet_id = _FileId.of(self.kubelet_socket)
        if kubelet_id is None:
            raise FileNotFoundError("kubelet.sock does not exist (is the kubelet running?)")
        with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
            pb_grpc.RegistrationStub(channel).Register(request, timeout=self.register_timeout)
        return kubelet_id


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


def _remove_socket(path: Path) -> None:
    try:
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()
        else:
            raise PluginServerError(
                f"{path} exists and is not a socket; move it away so the plugin can serve there"
            )
    except FileNotFoundError:
        pass
