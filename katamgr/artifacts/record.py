"""What an install in a runtime class dir is, and whether a dir is ours to replace.

``.katamgr-artifact.json`` in the dir records the reference, the manifest digest and each
file (digest, size, mtime): a run whose source offers the recorded digest transfers
nothing, a file whose size and mtime still match is not hashed again, and a dir without a
record but with files in it (kata-deploy's /opt/kata, an operator's own tree) is never
replaced or removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from .errors import ArtifactError

log = logging.getLogger(__name__)

RECORD_NAME = ".katamgr-artifact.json"


@dataclass(frozen=True)
class InstalledFile:
    name: str
    digest: str
    size: int
    mtime_ns: int  # when it was written; an unchanged mtime spares re-hashing every run


@dataclass(frozen=True)
class InstallRecord:
    """What ``.katamgr-artifact.json`` says is installed in a runtime class dir."""

    ref: str
    digest: str
    files: tuple[InstalledFile, ...]

    def to_json(self) -> dict:
        return {
            "ref": self.ref,
            "digest": self.digest,
            "files": {
                f.name: {"digest": f.digest, "size": f.size, "mtime_ns": f.mtime_ns}
                for f in self.files
            },
        }

    def text(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n"


def read_install(dest: Path) -> InstallRecord | None:
    """The record of the install in ``dest``, or None when there is none (or it is unreadable)."""
    try:
        doc = json.loads((Path(dest) / RECORD_NAME).read_text())
        files = tuple(
            InstalledFile(name, entry["digest"], int(entry["size"]), int(entry["mtime_ns"]))
            for name, entry in doc["files"].items()
        )
        return InstallRecord(str(doc["ref"]), str(doc["digest"]), files)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


class NotOursError(ArtifactError):
    """The destination holds something katamgr did not install."""


def check_ours(dest: Path) -> None:
    """Refuse a destination that is not ours to replace: a file, a symlink, or a
    directory with files in it but no install record (kata-deploy's /opt/kata,
    an operator's own tree). An empty directory, or none, is fine."""
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise NotOursError(f"{dest} exists and is not a directory katamgr made; it is left "
                           "as it is")
    if dest.is_dir() and read_install(dest) is None and any(dest.iterdir()):
        raise NotOursError(f"{dest} already holds files that katamgr did not install (no "
                           f"{RECORD_NAME} in it); it is left as it is")


def intact_files(dest: Path, record: InstallRecord, full: bool) -> dict[str, Path]:
    """Digest -> path of each recorded file still as installed."""
    intact: dict[str, Path] = {}
    for entry in record.files:
        path = dest / entry.name
        try:
            stat = path.lstat()
        except OSError:
            continue
        if not path.is_file() or path.is_symlink() or stat.st_size != entry.size:
            continue
        if full or stat.st_mtime_ns != entry.mtime_ns:
            if file_digest(path) != entry.digest:
                log.warning("%s differs from the installed %s; it will be replaced", path,
                            entry.digest)
                continue
        intact[entry.digest] = path
    return intact


def file_digest(path: Path) -> str:
    hasher = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1024 * 1024), b""):
            hasher.update(chunk)
    return "sha256:" + hasher.hexdigest()
