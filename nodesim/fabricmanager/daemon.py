"""The simulated node's Fabric Manager daemon: FM's unix socket, for processes that see FM's
directory read-only.

NVIDIA's FM listens on a unix socket (``FM_CMD_UNIX_SOCKET_PATH``) and keeps the fabric's state
in its own process, so a client needs only to connect: a pod given the socket's directory
read-only (the chart's mount) reaches it. The stand-in library keeps FM's state in a file
beside the socket, which such a pod cannot write. Run on the machine, this daemon listens on
FM's socket path and hands each connection a descriptor of that state file, opened here
(``SCM_RIGHTS``); the library reads and writes through it under the same ``flock`` as every
other caller. Without the daemon the socket path is a plain file and the library opens the
state itself (the quick tests).

``stop`` (FM stopped) removes the socket path and nothing answers until ``restart`` touches it
back into being; the daemon then listens there again.

    python -m nodesim.fabricmanager.daemon ROOT     serve ROOT's FM socket until SIGTERM
"""

from __future__ import annotations

import os
import select
import signal
import socket
import stat
import sys
from pathlib import Path

from nodesim.fabricmanager import SOCKET, state_of

TICK = 0.5  # how often the socket path is looked at (a restart after a stop)


def _listen(path: Path) -> socket.socket:
    """A listening socket at ``path``, replacing what is there (the placeholder ``start`` or
    ``restart`` touched) in one rename, so a caller never finds the path missing."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(tmp))
    server.listen(64)
    os.replace(tmp, path)
    return server


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.lstat().st_mode)
    except FileNotFoundError:
        return False


def _answer(server: socket.socket, state: Path) -> None:
    conn, _ = server.accept()
    with conn:
        try:
            fd = os.open(state, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return  # no state: the library answers FM_ST_CONNECTION_NOT_VALID
        try:
            conn.settimeout(5)
            socket.send_fds(conn, [b"F"], [fd])
        except OSError:
            pass  # the caller went away
        finally:
            os.close(fd)


def serve(root: Path, stopping) -> None:
    """Serve FM's socket under ``root`` until ``stopping()``."""
    path = root / SOCKET.lstrip("/")
    state = state_of(path)
    server = None
    print(f"serving Fabric Manager's socket {path} (state {state})", flush=True)
    while not stopping():
        if server is not None and not _is_socket(path):
            server.close()  # stopped (path removed) or started again (a plain file)
            server = None
        if server is None and path.exists() and state.is_file():
            server = _listen(path)
        ready = select.select([server] if server else [], [], [], TICK)[0]
        if ready:
            _answer(server, state)
    if server is not None:
        server.close()
        if _is_socket(path):
            path.unlink()  # FM stopped with its daemon


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m nodesim.fabricmanager.daemon ROOT", file=sys.stderr)
        return 2
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    serve(Path(argv[0]), lambda: bool(stop))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
