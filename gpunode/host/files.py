"""Atomic, change-only writes of host files.

Operators must never see a half-written config or a needless rewrite, so every
host file we own goes through ``write_atomic``: temp file in the same dir,
fsync, rename, fsync of the dir. It returns False (and touches nothing, mtime
included) when the content is already what we want.

A file we edit keeps its identity: the new content gets the old file's mode,
owner, group and extended attributes (an SELinux label, a user.* tag) before
the rename, so a containerd config holding registry credentials at 0600 stays
0600; and a symlink is followed, so its target is edited and the link stays a
link. Nothing we write is more readable than what it replaces.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any

from gpunode.host.faults import write_point


def write_atomic(path: Path, data: bytes | str, mode: int = 0o644, *, marked: bool = True) -> bool:
    """Write ``data`` to ``path`` atomically; return True when the file changed.

    ``mode`` applies to a new file only; an existing one keeps its own metadata.
    ``marked=False``: not a write point of the crash sweep (a witness such as the run
    journal, which changes nothing a later run must converge on).
    """
    if isinstance(data, str):
        data = data.encode()
    path = Path(os.path.realpath(path)) if Path(path).is_symlink() else Path(path)
    remove_stale_temps(path)  # a killed earlier write's, even when this one writes nothing
    try:
        if path.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    try:
        before = os.stat(path)
    except FileNotFoundError:
        before = None
    path.parent.mkdir(parents=True, exist_ok=True)
    if marked:
        write_point(f"write {path}")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            if before is None:
                os.fchmod(fh.fileno(), mode)
            else:
                _copy_identity(path, before, fh.fileno())
            os.fsync(fh.fileno())
        if marked:
            write_point(f"rename into {path}")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)
    return True


def _copy_identity(source: Path, st: os.stat_result, fd: int) -> None:
    """Give the open file ``fd`` the owner, group, mode and xattrs of ``source``."""
    if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
        os.fchown(fd, st.st_uid, st.st_gid)  # before chmod: chown clears set-id bits
    os.fchmod(fd, stat.S_IMODE(st.st_mode))
    try:
        names = os.listxattr(source)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return
        raise
    for name in names:
        os.setxattr(fd, name, os.getxattr(source, name))


# mkstemp(prefix=".<name>.", suffix=".tmp"): what write_atomic (and the cdi library's
# writer) leave behind when killed between creating the temp file and the rename.
_TEMP = re.compile(r"^\.(?P<name>.+)\.[A-Za-z0-9_]{8}\.tmp$")


def remove_stale_temps(path: Path, *, any_name: bool = False) -> list[Path]:
    """Remove the temp files a killed write of ``path`` left beside it (every
    write's, for any file of that dir, with ``any_name``); the paths removed."""
    path = Path(path)
    directory = path if any_name else path.parent
    removed = []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        match = _TEMP.match(entry.name)
        if match and (any_name or match["name"] == path.name) and entry.is_file(follow_symlinks=False):
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            removed.append(Path(entry.path))
    return removed


def fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_file(path: Path) -> bool:
    """Remove ``path``; return True when something was removed."""
    remove_stale_temps(Path(path))
    write_point(f"remove {path}")
    try:
        Path(path).unlink()
    except FileNotFoundError:
        return False
    fsync_dir(Path(path).parent)
    return True


def read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{path} is not valid JSON ({exc}); it is katamgr's record of what to undo: repair it, "
            f"or move it aside knowing that what it recorded can no longer be reverted"
        ) from exc


def write_json(path: Path, value: Any, *, marked: bool = True) -> bool:
    return write_atomic(path, json.dumps(value, indent=2, sort_keys=True) + "\n", mode=0o600, marked=marked)
