"""The artifact manifest, validated: what files to write, their digests and sizes.

A manifest comes from an untrusted registry or layout, so every field we act on is
checked here, once, for both sources: the media type, each layer's digest and size
(against the caps) and its title, which becomes a file name in the install dir.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from .errors import ArtifactError
from .refs import is_digest

MANIFEST_MEDIA_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
INDEX_MEDIA_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
TITLE_ANNOTATION = "org.opencontainers.image.title"
# A guest image's dm-verity parameters (Kata's kernel_verity_params form), for an artifact
# whose Kata config leaves them out; the root hash is checked against them before install.
VERITY_ANNOTATION = "kata-sandbox-manager.io/verity-params"
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_LAYER_BYTES = 4 * 1024 * 1024 * 1024
# our record lives in the install dir; no layer may overwrite it
RESERVED_PREFIX = ".katamgr"
# katamgr.runtime.kata_config writes the rewritten Kata config there
RENDERED_DIR = "rendered"
RESERVED_NAMES = (RENDERED_DIR,)


@dataclass(frozen=True)
class Layer:
    name: str  # the file name in the install dir (from the title annotation)
    digest: str
    size: int
    media_type: str
    verity_params: str = ""  # VERITY_ANNOTATION's value, when the layer has one


@dataclass(frozen=True)
class Manifest:
    digest: str  # sha256 of the exact manifest bytes
    media_type: str
    layers: tuple[Layer, ...]

    @property
    def total_size(self) -> int:
        return sum(layer.size for layer in self.layers)


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def check_file_name(title: Any, ref: str, digest: str) -> str:
    """A layer title is safe as a file name: plain, relative, inside the install dir."""
    if not isinstance(title, str) or not title:
        raise ArtifactError(
            f"{ref}: layer {digest} has no {TITLE_ANNOTATION} annotation, so it has no file "
            "name; push it with a title (oras push sets it from the file name)"
        )
    if (
        "/" in title
        or "\\" in title
        or "\0" in title
        or title in (".", "..")
        or title.startswith(RESERVED_PREFIX)
        or title in RESERVED_NAMES
        or len(title.encode()) > 255
    ):
        raise ArtifactError(
            f"{ref}: layer {digest} is titled {title!r}, which is not a plain file name inside "
            "the install dir (no '/', '..', leading '.katamgr', or 'rendered'); refusing to install it, "
            "push the file under its base name"
        )
    return title


def parse_manifest(
    data: bytes,
    ref: str,
    *,
    expected_digest: str | None = None,
    max_layer_bytes: int = DEFAULT_MAX_LAYER_BYTES,
    media_type: str | None = None,
) -> Manifest:
    """Validate raw manifest bytes; ``expected_digest`` is the ref's (or index's) digest."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ArtifactError(
            f"{ref}: the manifest is {len(data)} bytes, over the {MAX_MANIFEST_BYTES}-byte cap; "
            "this is not a Kata artifact manifest, check the ref"
        )
    digest = sha256_digest(data)
    if expected_digest and digest != expected_digest:
        raise ArtifactError(
            f"{ref}: the manifest's digest is {digest}, not the expected {expected_digest}; "
            "the registry or layout served different content, check the ref and the source"
        )
    try:
        # An OCI manifest is UTF-8 JSON; json.loads would guess UTF-16 or -32 from the first
        # bytes of anything else and fail in that codec's words.
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ArtifactError(
            f"{ref}: what was served as the manifest is not UTF-8 text (byte {data[exc.start]:#04x} at offset "
            f"{exc.start}), so not an OCI manifest; check that the ref names a Kata artifact and that the "
            "registry or layout serves it"
        ) from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ArtifactError(f"{ref}: the manifest is not valid JSON ({exc}); check that the ref names a Kata "
                            "artifact") from exc
    if not isinstance(doc, dict):
        raise ArtifactError(f"{ref}: the manifest is not a JSON object; check the ref")
    kind = doc.get("mediaType") or media_type or MANIFEST_MEDIA_TYPES[0]
    if kind in INDEX_MEDIA_TYPES or "manifests" in doc:
        raise ArtifactError(
            f"{ref}: names an image index (multi-platform), not one artifact manifest; "
            "use the digest of the platform's manifest instead"
        )
    if kind not in MANIFEST_MEDIA_TYPES or doc.get("schemaVersion") != 2:
        raise ArtifactError(
            f"{ref}: the manifest has media type {kind!r} (schemaVersion "
            f"{doc.get('schemaVersion')!r}); expected an OCI image manifest, check the ref"
        )
    raw_layers = doc.get("layers")
    if not isinstance(raw_layers, list) or not raw_layers:
        raise ArtifactError(
            f"{ref}: the manifest lists no layers, so there is nothing to install; check the ref"
        )
    layers: list[Layer] = []
    names: set[str] = set()
    for raw in raw_layers:
        layer = _parse_layer(raw, ref, max_layer_bytes)
        if layer.name in names:
            raise ArtifactError(
                f"{ref}: two layers are titled {layer.name!r}; each file must appear once, "
                "fix the artifact"
            )
        names.add(layer.name)
        layers.append(layer)
    return Manifest(digest, kind, tuple(layers))


def _parse_layer(raw: Any, ref: str, max_layer_bytes: int) -> Layer:
    if not isinstance(raw, dict):
        raise ArtifactError(f"{ref}: a manifest layer is not a JSON object; fix the artifact")
    digest = raw.get("digest")
    if not isinstance(digest, str) or not is_digest(digest):
        raise ArtifactError(
            f"{ref}: layer digest {digest!r} is not a sha256 digest; only sha256 is supported"
        )
    size = raw.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ArtifactError(f"{ref}: layer {digest} has size {size!r}, not a byte count")
    annotations = raw.get("annotations") or {}
    title = annotations.get(TITLE_ANNOTATION) if isinstance(annotations, dict) else None
    name = check_file_name(title, ref, digest)
    if size > max_layer_bytes:
        raise ArtifactError(
            f"{ref}: layer {name!r} ({digest}) is {size} bytes, over katamgr's {max_layer_bytes}-byte "
            "cap on one artifact file (a Kata kernel, image or config is far smaller; the cap is fixed, "
            "not a setting); check that the ref names a Kata runtime class artifact"
        )
    media_type = raw.get("mediaType")
    verity = annotations.get(VERITY_ANNOTATION) if isinstance(annotations, dict) else None
    return Layer(name, digest, size, media_type if isinstance(media_type, str) else "",
                 verity if isinstance(verity, str) else "")
