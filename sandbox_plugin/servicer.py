"""The DevicePlugin service's calls, bytes in and bytes out (``grpcwire`` serves them):
ListAndWatch from the thread that announced a change, GetPreferredAllocation, and
Allocate answered from encodings kept per set of device IDs while the resource hands out
the very same allocation."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from google.protobuf.message import DecodeError

from grpcwire.connection import ServerStream
from grpcwire.limits import shorten
from grpcwire.status import RpcError, StatusCode
from kubeletapi import deviceplugin_pb2 as pb
from sandbox_plugin.metrics import PluginMetrics
from sandbox_plugin.protoconv import container_answer, to_proto_devices
from sandbox_plugin.resources import (
    AllocationError,
    ContainerAllocation,
    PluginDevice,
    Resource,
    UnknownDeviceError,
)

log = logging.getLogger(__name__)

_SERVICE = "/v1beta1.DevicePlugin/"
# Allocate answers kept per set of device IDs; a node has at most a few dozen
# devices per resource, so this only bounds what odd requests can leave behind.
_ANSWER_CACHE_SIZE = 512


class _ListAndWatch:
    """One ListAndWatch call: the device list now, then again whenever it changes."""

    def __init__(self, servicer: DevicePluginServicer, stream: ServerStream) -> None:
        self.servicer = servicer
        self.stream = stream
        # Holds the read of the devices and the send together, so two changes
        # announced at once by two threads reach the kubelet in order.
        self._lock = threading.Lock()
        self._last: bytes | None = None

    def start(self) -> None:
        unsubscribe = self.servicer.resource.changes.subscribe(self.push)
        self.servicer.stream_opened()

        def closed() -> None:
            unsubscribe()
            self.servicer.stream_closed()

        self.stream.on_close(closed)
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


class DevicePluginServicer:
    """The DevicePlugin calls, bytes in and bytes out (``grpcwire``)."""

    def __init__(self, resource: Resource, metrics: PluginMetrics | None = None) -> None:
        self.resource = resource
        self.metrics = metrics
        # The kubelet's open ListAndWatch streams, and who is told when the last one ends (the
        # plugin server: the kubelet may have dropped us, see PluginServer).
        self.streams = 0
        self.on_last_stream_closed: Callable[[], None] | None = None
        self._streams_lock = threading.Lock()
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

    def stream_opened(self) -> None:
        with self._streams_lock:
            self.streams += 1

    def stream_closed(self) -> None:
        with self._streams_lock:
            self.streams -= 1
            last = self.streams == 0
        if last and self.on_last_stream_closed is not None:
            self.on_last_stream_closed()

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
        answer = container_answer(allocation)
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
