"""One gRPC service on one unix socket that the kubelet dials, kept there.

The kubelet reaches a device plugin on its socket in ``device-plugins/`` and a DRA
driver on its registration socket and endpoint; none may silently vanish. A
``ServedSocket`` serves its handlers with the plugins' gRPC transport
(``grpcwire``), knows the socket file it created (``FileId``) and
serves again when that file was removed or replaced, or when its serving loop
died; on stop it removes only its own file, never a newer one at the same path.
A loop that keeps dying (three times within ten minutes) makes the socket
unhealthy, which the device plugin's ``/healthz`` reports, so the kubelet's probe
restarts the container.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from grpcwire.server import GrpcServer, Streaming, Unary

log = logging.getLogger(__name__)

# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107
DEATHS_TOLERATED = 3
DEATHS_WINDOW = 600.0


class PluginServerError(Exception):
    """A plugin cannot serve at all (not a transient kubelet problem)."""


@dataclass(frozen=True)
class FileId:
    """Identity of a file, to tell 'the same socket' from 'a new one at the same path'."""

    dev: int
    ino: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileId | None:
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        return cls(st.st_dev, st.st_ino, st.st_ctime_ns)


def remove_socket(path: Path) -> None:
    try:
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()
        else:
            raise PluginServerError(
                f"{path} exists and is not a socket; move it away so the plugin can serve there"
            )
    except FileNotFoundError:
        pass


def answered(path: Path, timeout: float = 0.5) -> bool:
    """Whether a server accepts connections on the unix socket ``path`` now."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def check_socket_path(path: Path, fix: str) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise PluginServerError(
            f"socket path {path} is longer than the {MAX_SOCKET_PATH} bytes a unix socket "
            f"allows; {fix}")


class ServedSocket:
    def __init__(self, path: Path, unary: Mapping[str, Unary],
                 streaming: Mapping[str, Streaming] | None = None, *, name: str,
                 fix: str = "use a shorter path", on_failure: Callable[[], None] | None = None) -> None:
        check_socket_path(Path(path), fix)
        self.path = Path(path)
        self.name = name
        self.on_failure = on_failure  # told when the serving loop died (from its thread)
        self._unary = dict(unary)
        self._streaming = dict(streaming or {})
        self._grpc: GrpcServer | None = None
        self._id: FileId | None = None
        self._deaths: list[float] = []

    @property
    def intact(self) -> bool:
        """Ours, in place and served."""
        return (self._grpc is not None and self._grpc.alive and self._id is not None
                and FileId.of(self.path) == self._id)

    @property
    def taken_over(self) -> bool:
        """Another server answers at our path now (another instance of this plugin started there,
        removing the socket it found); ours still serves what the kubelet holds open."""
        now = FileId.of(self.path)
        return (self._grpc is not None and self._grpc.alive and now is not None and now != self._id
                and answered(self.path))

    @property
    def healthy(self) -> bool:
        """False once the serving loop died ``DEATHS_TOLERATED`` times in ``DEATHS_WINDOW`` s."""
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < DEATHS_WINDOW]
        return len(self._deaths) < DEATHS_TOLERATED

    def serve(self) -> bool:
        """Serve unless the socket is ours, in place and served; True when it (re)started."""
        if self.intact:
            return False
        if self._grpc is not None:
            if self._grpc.failure is not None:
                self._deaths.append(time.monotonic())
                log.error("%s: the gRPC loop on %s died (%s); serving it again", self.name,
                          self.path, self._grpc.failure)
            else:
                log.info("%s: socket %s was removed or replaced; serving it again", self.name, self.path)
        self.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        remove_socket(self.path)  # a stale one from an earlier run
        server = GrpcServer(str(self.path), self._unary, self._streaming, name=self.name,
                            on_failure=self.on_failure)
        server.start()
        self._grpc = server
        self._id = FileId.of(self.path)
        return True

    def stop(self) -> None:
        server, self._grpc = self._grpc, None
        if server is None:
            return
        server.stop()
        if self._id is not None and FileId.of(self.path) == self._id:
            remove_socket(self.path)
        self._id = None
