"""An OCI image layout on disk as an artifact source (air-gapped sites, the demo).

``index.json`` lists the manifests; a tag is the ``org.opencontainers.image.ref.name``
annotation of an index entry; every blob is ``blobs/sha256/<hex>``. The layout is as
untrusted as a registry: the installer verifies what we read here the same way.
"""

from __future__ import annotations

import json
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


class LayoutSource:
    def __init__(self, ref: LayoutRef) -> None:
        self.ref = ref
        self.description = str(ref)

    def fetch_manifest(self) -> FetchedManifest:
        descriptor = self._pick(self._index())
        digest = descriptor["digest"]
        path = blob_path(self.ref.path, digest)
        try:
            size = path.stat().st_size
            if size > MAX_MANIFEST_BYTES:
                raise ArtifactError(
                    f"{self.description}: manifest blob {path} is {size} bytes, over the "
                    f"{MAX_MANIFEST_BYTES}-byte cap; check the layout"
                )
            data = path.read_bytes()
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
            handle = path.open("rb")
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
            layout = json.loads(marker.read_bytes()[:4096])
            if index_path.stat().st_size > MAX_MANIFEST_BYTES:
                raise ArtifactError(
                    f"{self.description}: {index_path} is over the {MAX_MANIFEST_BYTES}-byte "
                    "cap; check the layout"
                )
            index = json.loads(index_path.read_bytes())
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
