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
# The run journal (gpunode.services.journal, which imports this module).
RUN_FILE = "run.json"
POLL_SECONDS = 0.05


class NodeBusyError(GpuNodeError):
    """Another katamgr process held the node lock for longer than we would wait."""


def holder_text(path: Path) -> str:
    """Who holds the lock, as the holder wrote it; "" when unknown."""
    try:
        info = json.loads(path.read_text() or "{}")
        return f"pid {int(info['pid'])} ({info['command']})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


@contextmanager
def node_lock(host: HostRoot, command: str, wait: float,
              on_wait: Callable[[str], None] | None = None) -> Iterator[Path]:
    """Hold the node lock for the block; NodeBusyError after ``wait`` seconds.

    ``on_wait`` gets one message when the lock is busy (default: a warning in the log).
    """
    path = host.state_path(LOCK_FILE)
    deadline = time.monotonic() + max(0.0, wait)
    told = False
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # again: a finished revert removes it
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:  # a read-only or full /var/lib: before any change, said as such
            raise GpuNodeError(f"cannot take the node lock {host.host_path(path)} ({exc.strerror or exc}): "
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
                raise NodeBusyError(
                    f"another katamgr holds the node lock {host.host_path(path)}: {who}; waited "
                    f"{wait:g} s (--wait), nothing was changed; run again when it has finished"
                ) from None
            if not told:
                told = True
                (on_wait or log.warning)(f"waiting up to {wait:g} s for the node lock held by {who}")
            time.sleep(POLL_SECONDS)
            continue
        if not _still_named(fd, path):
            os.close(fd)  # won the lock on a file a finished revert deleted: take the new one
            continue
        break
    try:
        me = json.dumps({"pid": os.getpid(), "command": command}).encode()
        # Said only when it changes: the agent's next reconcile with nothing to do writes nothing.
        if os.pread(fd, len(me) + 1, 0) != me:
            os.ftruncate(fd, 0)
            os.pwrite(fd, me, 0)
        yield path
    finally:
        os.close(fd)  # closing drops the flock


def lock_held(host: HostRoot) -> bool:
    """Whether a katamgr process holds the node lock now (read-only: a missing file is free)."""
    try:
        fd = os.open(host.state_path(LOCK_FILE), os.O_RDONLY | os.O_CLOEXEC)
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
    if left <= {LOCK_FILE, RUN_FILE}:
        # The run journal records a run, not a change: with nothing else left it goes too.
        if RUN_FILE in left:
            (state / RUN_FILE).unlink()
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
