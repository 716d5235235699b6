"""What we must remember to undo our containerd edits.

Kept under the HostRoot state dir (``/var/lib/kata-sandbox-manager/containerd/``):
the original bytes of the file we edit (taken before our first change), the hash of
what we last wrote (so revert can tell whether anyone else touched the file since),
and, for every key we set, the value it had before (so a surgical revert can put
it back when the file was edited by someone else too).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from katamgr.host.files import read_json, remove_file, write_atomic, write_json
from katamgr.host.root import HostRoot

RUNTIME = "runtime"  # a whole runtime table: always ours to remove or restore
VALUE = "value"  # a single setting: restored only while it still holds our value


@dataclass
class Entry:
    path: list[str]
    kind: str
    ours: Any
    had_prior: bool
    prior: Any = None


@dataclass
class EditState:
    target: str  # host path of the file we write (main config or our drop-in)
    mode: str  # "main" or "drop-in"
    version: int
    existed: bool  # did the target exist before our first change
    written_sha256: str = ""
    # False once someone else changed the file between two of our writes: the original
    # bytes are then no longer a safe thing to put back.
    pristine: bool = True
    entries: list[Entry] = field(default_factory=list)
    created_tables: list[list[str]] = field(default_factory=list)

    def entry(self, path: list[str] | tuple[str, ...]) -> Entry | None:
        for item in self.entries:
            if item.path == list(path):
                return item
        return None

    def runtime_names(self) -> list[str]:
        return [e.path[-1] for e in self.entries if e.kind == RUNTIME]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _stem(config_host_path: str) -> str:
    return "containerd/" + re.sub(r"[^A-Za-z0-9_.-]", "_", config_host_path.strip("/"))


def state_file(host: HostRoot, config_host_path: str) -> Path:
    return host.state_path(_stem(config_host_path) + ".json")


def original_file(host: HostRoot, config_host_path: str) -> Path:
    return host.state_path(_stem(config_host_path) + ".orig")


def load(host: HostRoot, config_host_path: str) -> EditState | None:
    raw = read_json(state_file(host, config_host_path))
    if raw is None:
        return None
    raw["entries"] = [Entry(**e) for e in raw.get("entries", [])]
    return EditState(**raw)


def save(host: HostRoot, config_host_path: str, state: EditState) -> None:
    write_json(state_file(host, config_host_path), asdict(state))


def keep_original(host: HostRoot, config_host_path: str, data: bytes | None) -> None:
    """Keep the bytes from before our first change (nothing when the file did not exist)."""
    if data is not None:
        write_atomic(original_file(host, config_host_path), data, mode=0o600)


def read_original(host: HostRoot, config_host_path: str) -> bytes | None:
    try:
        return original_file(host, config_host_path).read_bytes()
    except FileNotFoundError:
        return None


def forget(host: HostRoot, config_host_path: str) -> None:
    remove_file(state_file(host, config_host_path))
    remove_file(original_file(host, config_host_path))
