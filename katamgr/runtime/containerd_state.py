"""What we must remember to undo our containerd edits.

Kept under the HostRoot state dir (``/var/lib/kata-sandbox-manager/containerd/``),
in ONE file per config so that a single atomic rename makes all of it durable at
once: the original text of the file we edit (taken before our first change), the
hashes of the file before and after the write in flight (so we can tell our own
content from someone else's edit, even after a crash mid-write), and, for every
key we set, the value it had before (so a surgical revert can put it back when
the file was edited by someone else too).

The state is saved BEFORE every config write and describes both sides of it, so a
crash at any point leaves a state that still matches the file on disk.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpunode.host.files import read_json, remove_file, write_json
from gpunode.host.root import HostRoot

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
    # Hash of what we wrote last, or are about to write (saved before the write).
    written_sha256: str = ""
    # False once someone else changed the file between two of our writes: the original
    # bytes are then no longer a safe thing to put back.
    pristine: bool = True
    entries: list[Entry] = field(default_factory=list)
    created_tables: list[list[str]] = field(default_factory=list)
    # The target's text before our first change (None when it did not exist).
    original: str | None = None
    # Hash of the target just before the write in flight: if we died before that
    # write landed, the file still holds this and is no one else's edit.
    before_sha256: str = ""

    def entry(self, path: list[str] | tuple[str, ...]) -> Entry | None:
        for item in self.entries:
            if item.path == list(path):
                return item
        return None

    def runtime_names(self) -> list[str]:
        return [e.path[-1] for e in self.entries if e.kind == RUNTIME]

    def holds_ours(self, current: bytes | None) -> bool:
        """Does the target hold what we wrote (or what was there as our write began)?"""
        if current is None:
            return False  # we never delete the target, so a missing one is someone else's doing
        return sha256(current) in (self.written_sha256, self.before_sha256)

    def at_original(self, current: bytes | None) -> bool:
        """Is the target exactly as before our first change (nothing of ours in it)?"""
        if current is None:
            return not self.existed
        return self.original is not None and current == self.original.encode()

    def begin_write(self, current: bytes | None, new: bytes) -> None:
        self.before_sha256 = digest(current)
        self.written_sha256 = digest(new)

    def settle(self, current: bytes | None) -> None:
        """Record that the target holds ``current`` and no write of ours is in flight."""
        self.before_sha256 = self.written_sha256 = digest(current)


def digest(data: bytes | None) -> str:
    return "" if data is None else sha256(data)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _stem(config_host_path: str) -> str:
    return "containerd/" + re.sub(r"[^A-Za-z0-9_.-]", "_", config_host_path.strip("/"))


def state_file(host: HostRoot, config_host_path: str) -> Path:
    return host.state_path(_stem(config_host_path) + ".json")


def _legacy_original_file(host: HostRoot, config_host_path: str) -> Path:
    # Earlier releases kept the original bytes beside the state, in a separate file.
    return host.state_path(_stem(config_host_path) + ".orig")


def load(host: HostRoot, config_host_path: str) -> EditState | None:
    raw = read_json(state_file(host, config_host_path))
    if raw is None:
        return None
    raw["entries"] = [Entry(**e) for e in raw.get("entries", [])]
    if "original" not in raw:
        try:
            raw["original"] = _legacy_original_file(host, config_host_path).read_text()
        except FileNotFoundError:
            raw["original"] = None
    return EditState(**raw)


def save(host: HostRoot, config_host_path: str, state: EditState) -> None:
    write_json(state_file(host, config_host_path), asdict(state))


def forget(host: HostRoot, config_host_path: str) -> None:
    remove_file(state_file(host, config_host_path))
    remove_file(_legacy_original_file(host, config_host_path))
