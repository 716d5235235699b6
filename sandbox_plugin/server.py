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

The calls themselves are ``sandbox_plugin.servicer``'s (answered from what the resource
already holds, encoded by ``sandbox_plugin.protoconv``); the dir is watched by
``sandbox_plugin.dirwatch``.
"""

from __future__ import annotations

import logging
import threading

from gpunode.host.root import HostRoot
from gpunode.services.backoff import Backoff
from grpcwire.client import unary_call
from grpcwire.status import RpcError
from kubeletapi import deviceplugin_pb2 as pb
from kubeletapi.deviceplugin_paths import API_VERSION, DEVICE_PLUGIN_DIR, KUBELET_SOCKET
from sandbox_plugin.dirwatch import DirWatcher
from sandbox_plugin.metrics import PluginMetrics
from sandbox_plugin.resources import Resource
from sandbox_plugin.served import FileId, PluginServerError, ServedSocket
from sandbox_plugin.servicer import DevicePluginServicer

log = logging.getLogger(__name__)

_REGISTER = "/v1beta1.Registration/Register"
# How long after the kubelet closed our last stream we wait before registering again (see
# PluginServer._dropped_for_good): its goroutine for the dropped connection ends within it.
DROP_SETTLE = 0.05


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
        self._servicer = DevicePluginServicer(resource, metrics)
        self._socket = ServedSocket(
            self.socket_path, self._servicer.unary(), self._servicer.streaming(),
            name=f"dp-{resource.socket_name}", fix="use a shorter host root or socket name",
            on_failure=self._loop_died)
        self._stopping = threading.Event()
        self._registered = threading.Event()
        self._dropped = threading.Event()  # the kubelet closed our last ListAndWatch stream
        self._servicer.on_last_stream_closed = self._stream_dropped
        self._thread: threading.Thread | None = None
        self._watcher: DirWatcher | None = None

    # -- public ---------------------------------------------------------------

    def start(self) -> None:
        """Start serving and registering in the background; returns at once."""
        if self._thread is not None:
            raise PluginServerError(
                f"plugin server for {self.resource.resource_name} already started"
            )
        self._watcher = DirWatcher(self.socket_dir)
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

    def _stream_dropped(self) -> None:
        if not self._stopping.is_set():
            self._dropped.set()
            if self._watcher is not None:
                self._watcher.wake()

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
            self._dropped.clear()
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
                    if FileId.of(self.kubelet_socket) == kubelet_id and self._taken_over_after_a_moment():
                        self._yield(watched)  # another instance removed ours to serve there
                        break
                    log.info("%s: our socket was removed (kubelet restart?) or is not served; "
                             "serving again", name)
                    break
                if FileId.of(self.kubelet_socket) != kubelet_id:
                    log.info(
                        "%s: kubelet.sock was replaced (kubelet restart); registering again", name
                    )
                    break
                if self._dropped.is_set() and self._dropped_for_good():
                    log.info("%s: the kubelet closed our ListAndWatch stream, its socket and ours unchanged "
                             "(it drops a resource's current plugin when an earlier connection for that "
                             "resource ends: another instance of this plugin stopped); registering again",
                             name)
                    break
            self._registered.clear()
        self._registered.clear()

    def _dropped_for_good(self) -> bool:
        """After the kubelet closed our last stream: whether it still has none open once its
        handling of the closed connection is over. The kubelet (k8s.io/kubernetes v1.35.4,
        pkg/kubelet/cm/devicemanager/plugin/v1beta1/handler.go ``runClient``) disconnects whatever
        client is registered for the resource when any connection to a plugin of it ends, the one
        it just dropped included: registering again before that is done would be dropped too."""
        self._stopping.wait(DROP_SETTLE)
        self._dropped.clear()
        return not self._stopping.is_set() and self._servicer.streams == 0

    def _taken_over_after_a_moment(self) -> bool:
        """Our socket gone while the kubelet's stayed: another instance may be between removing
        ours and serving its own there (never fight it for the path)."""
        self._stopping.wait(DROP_SETTLE)
        return self._socket.taken_over

    def _yield(self, watched: frozenset[str]) -> None:
        """Another instance serves our socket (a surge's new pod, or one started by hand beside
        this one): this one keeps answering on what the kubelet holds open, and serves and registers
        again only if the other goes away first."""
        name = self.resource.resource_name
        log.info("%s: another instance of this plugin serves %s now; this one answers the kubelet's open "
                 "connection until it stops", name, self.host_root.host_path(self.socket_path))
        while not self._stopping.is_set() and self._socket.taken_over:
            assert self._watcher is not None
            self._watcher.wait(self.recheck_interval, watched)
        if not self._stopping.is_set():
            log.info("%s: the other instance left %s; serving it again", name, self.host_root.host_path(self.socket_path))

    def _register(self) -> FileId:
        """Serve our socket (again, if it is not ours, in place and served) and register with the
        kubelet; return the identity of the kubelet.sock used."""
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
        # Only now, with this kubelet's socket seen: a starting kubelet removes every socket in the
        # dir before it serves kubelet.sock (k8s.io/kubernetes v1.35.4 devicemanager
        # CleanupPluginDirectory), so ours checked before that could be gone by the time it dials.
        if self._socket.serve():
            log.debug("%s: serving DevicePlugin on %s", self.resource.resource_name, self.socket_path)
        unary_call(str(self.kubelet_socket), _REGISTER, request.SerializeToString(), self.register_timeout)
        return kubelet_id


def _describe(exc: BaseException) -> str:
    if isinstance(exc, RpcError):
        return f"{exc.code.name}: {exc.details}"
    return str(exc)

