"""Make containerd pick up a changed config, the way the operator chose.

Call this only after ``ContainerdChange.needs_reload``: an unchanged config never
restarts containerd. Modes (GPU Operator ``restartMode``):

- ``signal``: SIGHUP to the process that owns containerd's socket. containerd has no
  SIGHUP handler, so the default action ends it and its service manager starts it
  again with the new config (the GPU Operator's behaviour).
- ``systemd``: ``systemctl restart containerd``; through ``chroot <root>`` when the
  host is mounted somewhere other than ``/`` (a DaemonSet with the host at /host).
- ``none``: only log that the operator must restart containerd.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import struct
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpunode.errors import ConfigError, GpuNodeError
from gpunode.host.root import HostRoot
from katamgr.runtime.settings import DEFAULT_SOCKET, DEFAULT_UNIT, RestartMode

log = logging.getLogger(__name__)

_SOCKET_LINK = re.compile(r"^socket:\[(\d+)\]$")


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    output: str


CommandRunner = Callable[[Sequence[str]], CommandResult]
SignalSender = Callable[[int, int], None]


def run_command(argv: Sequence[str]) -> CommandResult:
    """The real runner: an argument list, never a shell."""
    proc = subprocess.run(  # noqa: S603 - fixed argument list, no shell
        list(argv), capture_output=True, text=True, timeout=120, check=False
    )
    return CommandResult(proc.returncode, (proc.stdout + proc.stderr).strip())


@dataclass(frozen=True)
class ReloadResult:
    mode: RestartMode
    done: bool  # containerd was told to restart
    message: str


def socket_inodes(host: HostRoot, socket_path: str) -> set[int]:
    """Inodes of unix sockets bound to ``socket_path`` (host path), from /proc/net/unix.

    /proc/net/unix lists the reader's own network namespace; PID 1's table is the
    host's (in a pod sharing the host's PID namespace, or through the host's /proc
    under the host root), so it is read first and the pod needs no host network.
    """
    inodes: set[int] = set()
    lines: list[str] = []
    for table in ("/proc/1/net/unix", "/proc/net/unix"):
        try:
            lines += host.path(table).read_text().splitlines()[1:]
        except OSError:
            continue
    for line in lines:
        # Num RefCount Protocol Flags Type St Inode [Path]
        fields = line.split(None, 7)
        if len(fields) == 8 and fields[7] == socket_path:
            inodes.add(int(fields[6]))
    return inodes


def socket_owner(host: HostRoot, socket_path: str) -> int | None:
    """PID of the process serving the socket bound at ``socket_path``, if any.

    The socket says it itself: a connection's SO_PEERCRED is the PID that listens, as
    this process's PID namespace numbers it (the host's, with hostPID). That needs
    neither the host network nor a look at other processes' descriptors. Where it
    gives nothing (no socket to connect to, or PID 0: the listener is outside this
    PID namespace), the host's unix socket table and /proc/<pid>/fd are searched.
    """
    pid = peer_pid(host.path(socket_path))
    if pid is not None:
        return pid
    inodes = socket_inodes(host, socket_path)
    if not inodes:
        return None
    proc = host.path("/proc")
    for entry in sorted(proc.iterdir(), key=lambda p: p.name):
        if not entry.name.isdigit() or entry.name == "1":
            continue  # init holds it only to hand it over (socket activation)
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue  # gone, or not ours to look at
        for fd in fds:
            try:
                match = _SOCKET_LINK.match(os.readlink(fd))
            except OSError:
                continue
            if match and int(match.group(1)) in inodes:
                return int(entry.name)
    return None


def peer_pid(path: Path) -> int | None:
    """The PID behind the unix socket at ``path``, from SO_PEERCRED; None when it cannot
    be had or is not one to signal."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(_CONNECT_SECONDS)  # a full backlog would block connect
            sock.connect(str(path))
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    pid, _uid, _gid = _UCRED.unpack(creds)
    # 0: the listener is outside this PID namespace. 1: init listened and handed the socket
    # over (socket activation); SIGHUP would make init reload, not restart containerd.
    return pid if pid > 1 else None


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_CONNECT_SECONDS = 2.0


def systemctl_argv(host: HostRoot, unit: str = DEFAULT_UNIT) -> list[str]:
    argv = ["systemctl", "restart", unit]
    return argv if host.is_real_root else ["chroot", str(host.root), *argv]


def reload_containerd(
    host: HostRoot,
    mode: RestartMode | str,
    *,
    socket_path: str = DEFAULT_SOCKET,
    unit: str = DEFAULT_UNIT,
    runner: CommandRunner = run_command,
    send_signal: SignalSender = os.kill,
    purpose: str = "load the Kata runtimes",
) -> ReloadResult:
    """Make containerd read its config again, as ``mode`` says; ``purpose`` ends the
    message that asks the operator to restart it ("drop the Kata runtimes" on revert)."""
    try:
        mode = RestartMode(mode)
    except ValueError:
        raise ConfigError(
            f"restartMode {mode!r} is not known; use {', '.join(list(RestartMode)[:-1])} "
            f"or {list(RestartMode)[-1]}"
        ) from None
    if mode is RestartMode.NONE:
        message = f"containerd config changed; restart containerd to {purpose}"
        log.warning(message)
        return ReloadResult(mode, False, message)
    if mode is RestartMode.SIGNAL:
        pid = socket_owner(host, socket_path)
        if pid is None:
            message = (
                f"no process holds containerd's socket {socket_path}; restart containerd "
                f"yourself (is it running, and does this pod share the host's PID namespace?)"
            )
            log.warning(message)
            return ReloadResult(mode, False, message)
        send_signal(pid, signal.SIGHUP)
        message = f"sent SIGHUP to containerd (pid {pid})"
        log.info(message)
        return ReloadResult(mode, True, message)
    argv = systemctl_argv(host, unit)
    result = runner(argv)
    if result.returncode != 0:
        raise GpuNodeError(
            f"'{' '.join(argv)}' failed with exit code {result.returncode} ({result.output}); "
            f"restart containerd by hand or set restartMode to signal"
        )
    message = f"restarted containerd with '{' '.join(argv)}'"
    log.info(message)
    return ReloadResult(mode, True, message)
