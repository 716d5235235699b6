"""Atomic, change-only writes of host files.

Operators must never see a half-written config or a needless rewrite, so every
host file we own goes through ``write_atomic``: temp file in the same dir,
fsync, rename, fsync of the dir. It returns False (and touches nothing, mtime
included) when the content is already what we want.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_atomic(path: Path, data: bytes | str, mode: int = 0o644) -> bool:
    """Write ``data`` to ``path`` atomically; return True when the file changed."""
    if isinstance(data, str):
        data = data.encode()
    path = Path(path)
    try:
        if path.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)
    return True


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


def write_json(path: Path, value: Any) -> bool:
    return write_atomic(path, json.dumps(value, indent=2, sort_keys=True) + "\n", mode=0o600)
