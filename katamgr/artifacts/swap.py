"""One installer per runtime class dir, and the new install swapped in whole.

The staged dir replaces the destination in one rename (``renameat2(RENAME_EXCHANGE)``);
where the filesystem lacks it, two renames, and a crash between them is finished by the
next run's ``recover``, which also drops what killed runs left beside the dir (ours by
name: ``.<name>.old-*``, ``.<name>.staging-*``, ``.<name>.removing-*``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from gpunode.host.faults import write_point
from gpunode.host.files import fsync_dir

from .record import read_install

log = logging.getLogger(__name__)


def lock_path(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.lock"


def leftovers(dest: Path) -> list[Path]:
    """What killed installs or removals of ``dest`` left beside it (ours by name)."""
    return [p for kind in ("old", "staging", "removing")
            for p in dest.parent.glob(f".{dest.name}.{kind}-*")]


@contextlib.contextmanager
def locked(dest: Path) -> Iterator[None]:
    """One installer per runtime class dir at a time (two agents, or a CLI run beside one)."""
    with lock_path(dest).open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def recover(dest: Path) -> None:
    """Finish a swap a crash interrupted, and drop leftovers of earlier runs."""
    leftovers = sorted(dest.parent.glob(f".{dest.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if not dest.exists() and leftovers and read_install(leftovers[-1]) is not None:
        os.rename(leftovers.pop(), dest)
        fsync_dir(dest.parent)
        log.warning("restored %s from an install swap a crash interrupted", dest)
    for stale in [*leftovers, *dest.parent.glob(f".{dest.name}.staging-*"),
                  *dest.parent.glob(f".{dest.name}.removing-*")]:
        write_point(f"delete leftover {stale}")
        shutil.rmtree(stale, ignore_errors=True)


def swap(staging: Path, dest: Path) -> None:
    if not dest.exists() and not dest.is_symlink():
        os.rename(staging, dest)
    elif dest.is_dir() and not dest.is_symlink() and _exchange(staging, dest):
        shutil.rmtree(staging, ignore_errors=True)  # staging now holds the old install
    else:
        # no atomic exchange here: a crash between the two renames leaves the old install
        # complete under .<name>.old-*, and the next run's recover puts it back
        old = dest.parent / f".{dest.name}.old-{os.getpid()}-{time.monotonic_ns()}"
        os.rename(dest, old)
        write_point(f"rename {staging} to {dest}")
        os.rename(staging, dest)
        fsync_dir(dest.parent)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
    fsync_dir(dest.parent)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with renameat2; False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))
