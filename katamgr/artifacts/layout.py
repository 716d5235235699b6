"""An OCI image layout on disk as an artifact source (air-gapped sites, the demo).

``index.json`` lists the manifests; a tag is the ``org.opencontainers.image.ref.name``
annotation of an index entry; every blob is ``blobs/sha256/<hex>``. The layout is as
untrusted as a registry: the installer verifies what we read here the same way, and
every file is opened without blocking and read only when it is a regular file (a
FIFO would hang the reader, ``/dev/zero`` would never end), up to a cap.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import ArtifactError
from .manifest import MANIFEST_MEDIA_TYPES, MAX_MANIFEST_BYTES, Layer
from .refs import LayoutRef, is_digest
from .source import FetchedManifest

REF_NAME_ANNOTATION = "org.opencontainers.image.ref.name"
CHUNK_BYTES = 1024 * 1024


def blob_path(layout: Path, digest: str) -> Path:
    algorithm, hexdigest = digest.split(":", 1)
    return layout / "blobs" / algorithm / hexdigest


MARKER_MAX_BYTES = 4096


def open_regular(path: Path) -> int:
    """An fd of ``path`` opened for reading, refused unless it is a regular file.

    O_NONBLOCK makes opening a FIFO return at once instead of waiting for a writer;
    it is cleared again, as regular files ignore it anyway.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(path, mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class NotRegularFile(OSError):
    def __init__(self, path: Path, mode: int) -> None:
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "a directory" if stat.S_ISDIR(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a regular file")
        super().__init__(f"is {kind}, not a regular file")
        self.filename = str(path)
        self.strerror = f"is {kind}, not a regular file"


def read_capped(path: Path, cap: int, what: str, description: str) -> bytes:
    """The bytes of regular file ``path``, refused when longer than ``cap``."""
    with os.fdopen(open_regular(path), "rb") as handle:
        data = handle.read(cap + 1)
    if len(data) > cap:
        raise ArtifactError(f"{description}: {what} {path} is over the {cap}-byte cap; check the layout")
    return data


class LayoutSource:
    def __init__(self, ref: LayoutRef) -> None:
        self.ref = ref
        self.description = str(ref)

    def fetch_manifest(self) -> FetchedManifest:
        descriptor = self._pick(self._index())
        digest = descriptor["digest"]
        path = blob_path(self.ref.path, digest)
        try:
            data = read_capped(path, MAX_MANIFEST_BYTES, "manifest blob", self.description)
        except OSError as exc:
            raise ArtifactError(
                f"{self.description}: cannot read manifest blob {path} ({exc.strerror}); "
                "the layout is incomplete, copy it again"
            ) from exc
        if descriptor.get("size") != len(data):
            raise ArtifactError(
                f"{self.description}: manifest blob {path} is {len(data)} bytes but index.json "
                f"says {descriptor.get('size')}; the layout is damaged, copy it again"
            )
        return FetchedManifest(data, descriptor.get("mediaType"), digest)

    @contextmanager
    def open_blob(self, layer: Layer) -> Iterator[Iterator[bytes]]:
        path = blob_path(self.ref.path, layer.digest)
        try:
            handle = os.fdopen(open_regular(path), "rb")
        except OSError as exc:
            raise ArtifactError(
                f"{self.description}: cannot read blob {layer.digest} ({layer.name}) at {path} "
                f"({exc.strerror}); the layout is incomplete, copy it again"
            ) from exc
        with handle:
            yield iter(lambda: handle.read(CHUNK_BYTES), b"")

    def _index(self) -> dict:
        root = self.ref.path
        marker, index_path = root / "oci-layout", root / "index.json"
        try:
            layout = json.loads(read_capped(marker, MARKER_MAX_BYTES, "marker", self.description))
            index = json.loads(read_capped(index_path, MAX_MANIFEST_BYTES, "index", self.description))
        except OSError as exc:
            raise ArtifactError(
                f"{self.description}: {root} is not a readable OCI image layout "
                f"({exc.filename}: {exc.strerror}); point the ref at a dir holding oci-layout "
                "and index.json"
            ) from exc
        except ValueError as exc:
            raise ArtifactError(
                f"{self.description}: {root} has invalid JSON in oci-layout or index.json "
                f"({exc}); copy the layout again"
            ) from exc
        if not isinstance(layout, dict) or "imageLayoutVersion" not in layout:
            raise ArtifactError(
                f"{self.description}: {marker} has no imageLayoutVersion; this is not an OCI "
                "image layout"
            )
        if not isinstance(index, dict) or not isinstance(index.get("manifests"), list):
            raise ArtifactError(
                f"{self.description}: {index_path} has no 'manifests' list; this is not an OCI "
                "image layout"
            )
        return index

    def _pick(self, index: dict) -> dict:
        entries = [
            entry for entry in index["manifests"]
            if isinstance(entry, dict) and isinstance(entry.get("digest"), str)
            and is_digest(entry["digest"])
        ]
        tags = sorted(
            str(entry.get("annotations", {}).get(REF_NAME_ANNOTATION))
            for entry in entries
            if isinstance(entry.get("annotations"), dict)
            and REF_NAME_ANNOTATION in entry["annotations"]
        )
        if self.ref.digest:
            matches = [entry for entry in entries if entry["digest"] == self.ref.digest]
            wanted = f"digest {self.ref.digest}"
        elif self.ref.tag:
            matches = [
                entry for entry in entries
                if isinstance(entry.get("annotations"), dict)
                and entry["annotations"].get(REF_NAME_ANNOTATION) == self.ref.tag
            ]
            wanted = f"tag {self.ref.tag!r}"
        else:
            matches = entries if len(entries) == 1 else []
            wanted = "a single manifest (no tag given)"
        if not matches:
            raise ArtifactError(
                f"{self.description}: index.json has no manifest for {wanted}; "
                f"use one of its tags {tags}"
            )
        entry = matches[0]
        media_type = entry.get("mediaType")
        if media_type and media_type not in MANIFEST_MEDIA_TYPES:
            raise ArtifactError(
                f"{self.description}: the index entry for {wanted} has media type "
                f"{media_type!r}, not an image manifest; pick a manifest's tag or digest"
            )
        return entry
