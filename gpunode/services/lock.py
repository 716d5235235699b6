"""One writer per node: the lock every katamgr process holds while it changes the host.

Two runs at once (three ``apply``, or ``katamgr run`` beside a manual ``revert``)
would each read the device records, bind or unbind, and write the records back:
GPUs end up on vfio-pci with no record left to give them back. So every command
that changes the host holds ``/var/lib/kata-sandbox-manager/node.lock`` (an
``flock``) for its whole read-modify-write; a second one waits, saying who holds
it, up to ``--wait`` seconds, then fails with exit 1 having changed nothing.

The holder writes who it is into the file (pid and command) for the
waiter's message; the kernel drops the lock when the holder dies, even by kill -9.
``release(remove=True)`` deletes the file while still holding it (revert leaves
nothing behind); a waiter that then wins the lock on the deleted file notices the
path no longer names its inode and takes the lock again on the new file.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from gpunode.errors import GpuNodeError
from gpunode.host.files import remove_stale_temps
from gpunode.host.root import HostRoot

log = logging.getLogger(__name__)

LOCK_FILE = "node.lock"
AGENT_LOCK_FILE = "agent.lock"  # held by the one agent (``agent_lock``)
# The run journal (gpunode.services.journal, which imports this module).
RUN_FILE = "run.json"
POLL_SECONDS = 0.05


class NodeBusyError(GpuNodeError):
    """Another katamgr process held the node lock for longer than we would wait."""


def holder_text(path: Path) -> str:
    """Who holds the lock, as the holder wrote it; "" when unknown."""
    try:
        info = json.loads(path.read_text() or "{}")
        config = f", config {info['config']}" if info.get("config") else ""
        return f"pid {int(info['pid'])} ({info['command']}{config})"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ""


@contextmanager
def node_lock(host: HostRoot, command: str, wait: float,
              on_wait: Callable[[str], None] | None = None) -> Iterator[Path]:
    """Hold the node lock for the block; NodeBusyError after ``wait`` seconds.

    ``on_wait`` gets one message when the lock is busy (default: a warning in the log).
    """
    def busy(where: str, who: str) -> str:
        return (f"another katamgr holds the node lock {where}: {who}; waited {wait:g} s (--wait), "
                "nothing was changed; run again when it has finished")

    with _flock(host, LOCK_FILE, {"pid": os.getpid(), "command": command}, wait, busy,
                on_wait or log.warning, "the node lock") as path:
        yield path


@contextmanager
def agent_lock(host: HostRoot, command: str, config: str | None, wait: float) -> Iterator[Path]:
    """One agent per node: held by ``katamgr run`` for its whole life (``apply`` refuses
    beside it: ``refuse_beside_agent``). The node lock is held only for each reconcile, so two agents (two configs) would
    take it in turn, each rewriting containerd's config back to its own; a second one waits
    up to ``wait`` seconds, then fails naming the first (PID, command, config)."""
    def busy(where: str, who: str) -> str:
        return (f"another katamgr agent runs on this node ({who}; lock {where}): one agent per node, or "
                f"two configs rewrite containerd's config in turn; waited {wait:g} s (--wait), nothing was "
                "changed; stop that one first (or run this one with its config)")

    info = {"pid": os.getpid(), "command": command, "config": os.path.abspath(config) if config else None}
    try:
        with _flock(host, AGENT_LOCK_FILE, info, wait, busy, log.warning, "the agent lock") as path:
            yield path
    finally:
        _drop_lone_agent_lock(host)


def agent_holder(host: HostRoot) -> str | None:
    """Who runs as the node's agent now (pid, command, config), or None (read-only)."""
    path = host.state_path(AGENT_LOCK_FILE)
    return (holder_text(path) or "another process") if _held(path) else None


def refuse_beside_agent(host: HostRoot, command: str) -> None:
    """``apply`` beside a running agent: the agent would put its own config back."""
    who = agent_holder(host)
    if who is not None:
        raise NodeBusyError(f"a katamgr agent runs on this node ({who}): it keeps the node as its config "
                            f"says and would undo what `{command}` changes; nothing was changed: change the "
                            "agent's config (Helm values) instead, or stop it first")


def _drop_lone_agent_lock(host: HostRoot) -> None:
    """After a revert (--revert-on-exit) the locks may be all that is left: no trace."""
    state = host.state_path(".")
    try:
        names = {p.name for p in state.iterdir()}
        if AGENT_LOCK_FILE in names and names <= {AGENT_LOCK_FILE, LOCK_FILE} and not any(
                _held(state / n) for n in names):
            for name in names:
                (state / name).unlink()
            state.rmdir()
    except OSError:
        pass  # another run's files arrived, or a mount point: left as it is


@contextmanager
def _flock(host: HostRoot, name: str, info: dict, wait: float, busy: Callable[[str, str], str],
           on_wait: Callable[[str], None], what: str) -> Iterator[Path]:
    path = host.state_path(name)
    deadline = time.monotonic() + max(0.0, wait)
    told = False
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # again: a finished revert removes it
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:  # a read-only or full /var/lib: before any change, said as such
            raise GpuNodeError(f"cannot take {what} {host.host_path(path)} ({exc.strerror or exc}): "
                               f"katamgr keeps its records there, so it must be writable; nothing was "
                               "changed") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            who = holder_text(path) or "another process"
            if time.monotonic() >= deadline:
                raise NodeBusyError(busy(str(host.host_path(path)), who)) from None
            if not told:
                told = True
                on_wait(f"waiting up to {wait:g} s for {what} held by {who}")
            time.sleep(POLL_SECONDS)
            continue
        if not _still_named(fd, path):
            os.close(fd)  # won the lock on a file a finished revert deleted: take the new one
            continue
        break
    try:
        me = json.dumps(info).encode()
        # Said only when it changes: the agent's next reconcile with nothing to do writes nothing.
        if os.pread(fd, len(me) + 1, 0) != me:
            os.ftruncate(fd, 0)
            os.pwrite(fd, me, 0)
        yield path
    finally:
        os.close(fd)  # closing drops the flock


def lock_held(host: HostRoot) -> bool:
    """Whether a katamgr process holds the node lock now (read-only: a missing file is free)."""
    return _held(host.state_path(LOCK_FILE))


def _held(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return True
        raise
    finally:
        os.close(fd)  # closing drops a lock this took
    return False


def tidy_state_dir(host: HostRoot) -> None:
    """At the end of a revert, with the lock held: drop what killed runs left in the
    state dir (temp files, empty dirs) and, when no record is left, the lock file and
    the dir itself, so a reverted node keeps no trace of katamgr."""
    state = host.state_path(".").resolve()
    if not state.is_dir():
        return
    for dirpath, _dirnames, _filenames in os.walk(state, topdown=False):
        directory = Path(dirpath)
        remove_stale_temps(directory, any_name=True)  # the whole dir is ours
        if directory != state and not any(directory.iterdir()):
            directory.rmdir()
    left = {p.name for p in state.iterdir()}
    if left <= {LOCK_FILE, RUN_FILE, AGENT_LOCK_FILE}:
        # The run journal records a run, not a change: with nothing else left it goes too.
        if RUN_FILE in left:
            (state / RUN_FILE).unlink()
        if AGENT_LOCK_FILE in left and not _held(state / AGENT_LOCK_FILE):
            (state / AGENT_LOCK_FILE).unlink()  # an agent gone; one running keeps it
    if {p.name for p in state.iterdir()} == {LOCK_FILE}:
        (state / LOCK_FILE).unlink()  # a waiter holding the old inode retries (see node_lock)
        try:
            state.rmdir()
        except OSError as exc:
            # In a pod (the chart's uninstall hook) the dir is the mount of a hostPath
            # volume: only the kubelet can remove it, and leaving it empty keeps nothing.
            if exc.errno != errno.EBUSY:
                raise
            log.info("left %s empty: it is a mount point here", host.host_path(state))


def _still_named(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False
