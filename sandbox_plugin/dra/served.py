"""One gRPC service on one unix socket that the kubelet dials, kept there.

The kubelet finds a DRA driver by its registration socket and reaches it on the
endpoint that registration names; neither socket may silently vanish. A
``ServedSocket`` serves its handlers with the plugin's own gRPC transport
(``sandbox_plugin.wire``), knows the socket file it created (``server.FileId``) and
serves again when that file was removed or replaced; on stop it removes only its
own file, never a newer one at the same path.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from sandbox_plugin.server import MAX_SOCKET_PATH, FileId, PluginServerError, remove_socket
from sandbox_plugin.wire.server import GrpcServer, Unary

log = logging.getLogger(__name__)


class ServedSocket:
    def __init__(self, path: Path, unary: Mapping[str, Unary], *, name: str) -> None:
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise PluginServerError(
                f"socket path {path} is longer than the {MAX_SOCKET_PATH} bytes a unix socket "
                "allows; use a shorter --kubelet-dir or --driver-name")
        self.path = Path(path)
        self.name = name
        self._unary = dict(unary)
        self._grpc: GrpcServer | None = None
        self._id: FileId | None = None

    @property
    def intact(self) -> bool:
        return self._grpc is not None and self._id is not None and FileId.of(self.path) == self._id

    def serve(self) -> bool:
        """Serve unless the socket is ours and in place; True when it (re)started."""
        if self.intact:
            return False
        if self._grpc is not None:
            log.info("%s: socket %s was removed or replaced; serving it again", self.name, self.path)
        self.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        remove_socket(self.path)  # a stale one from an earlier run
        server = GrpcServer(str(self.path), self._unary, name=self.name)
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
