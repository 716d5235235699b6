"""OCI image layouts, written with the standard library only (hack/image/build).

An image as a tar archive of an OCI image layout (image-spec v1.1):

    oci-layout                 {"imageLayoutVersion": "1.0.0"}
    index.json                 one entry, named by the annotations
                               org.opencontainers.image.ref.name and io.containerd.image.name:
                               an image index (one manifest per platform), or a manifest
    blobs/sha256/<hex>         the index, and per platform its manifest, config and layer
                               (each image has one layer, a gzip'd tar)

The layer lists a root filesystem directory depth first in name order, every mtime
clamped to SOURCE_DATE_EPOCH, numeric owners only, the gzip header without a name or a
time, so the same tree gives the same bytes. `ctr images import` (containerd 1.6 and 2.x)
names the image from io.containerd.image.name (and takes its own platform's manifest out
of an index); tools that read the OCI annotation (skopeo's oci-archive:) from
org.opencontainers.image.ref.name. `skopeo copy --all` pushes the index and every platform.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
REF_NAME = "org.opencontainers.image.ref.name"
CONTAINERD_NAME = "io.containerd.image.name"


class _Hashing:
    """A write-only file that hashes and counts what passes through it."""

    def __init__(self, out) -> None:
        self.out = out
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.out.write(data)

    def flush(self) -> None:
        self.out.flush()


@dataclass(frozen=True)
class Layer:
    path: Path  # the gzip'd tar, named by its digest once written
    digest: str  # sha256:<hex> of the gzip'd bytes
    size: int
    diff_id: str  # sha256:<hex> of the tar
    unpacked: int  # bytes of file content
    entries: int  # members of the tar


def _walk(root: Path, rel: str = ""):
    """(path on disk, name in the layer) depth first, each directory before its
    contents, siblings in byte order of their names."""
    with os.scandir(root / rel if rel else root) as it:
        names = sorted(e.name for e in it)
    for name in names:
        arc = f"{rel}/{name}" if rel else name
        full = root / arc
        yield full, arc
        if full.is_dir() and not full.is_symlink():
            yield from _walk(root, arc)


def write_layer(root: Path, out_dir: Path, epoch: int, *, skip=lambda arc: False) -> Layer:
    """Packs the tree under ``root`` into a gzip'd tar in ``out_dir``. ``skip(arc)``
    leaves a member out (and, for a directory, what is under it)."""
    tmp = out_dir / ".layer.tmp"
    unpacked = entries = 0
    with open(tmp, "wb") as raw:
        gz_hash = _Hashing(raw)
        with gzip.GzipFile(filename="", mode="wb", fileobj=gz_hash, mtime=0, compresslevel=9) as gz:
            tar_hash = _Hashing(gz)
            with tarfile.open(fileobj=tar_hash, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                skipped: list[str] = []
                for full, arc in _walk(root):
                    if skipped and (arc + "/").startswith(skipped[-1] + "/"):
                        continue
                    if skip(arc):
                        skipped.append(arc)
                        continue
                    info = tar.gettarinfo(str(full), arcname=arc)
                    if info is None:  # a socket: nothing a container can use
                        continue
                    info.mtime = min(int(info.mtime), epoch)
                    info.uname = info.gname = ""
                    xattrs = _xattrs(full)
                    if xattrs:
                        info.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in xattrs.items()}
                    entries += 1
                    if info.isreg():
                        unpacked += info.size
                        with open(full, "rb") as f:
                            tar.addfile(info, f)
                    else:
                        tar.addfile(info)
    digest = gz_hash.sha.hexdigest()
    path = out_dir / digest
    os.replace(tmp, path)
    return Layer(path, "sha256:" + digest, gz_hash.size, "sha256:" + tar_hash.sha.hexdigest(),
                 unpacked, entries)


def _xattrs(path: Path) -> dict[str, str]:
    """Extended attributes worth keeping (file capabilities), as pax values."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    out = {}
    for name in sorted(names):
        if name.startswith("security.capability"):
            out[name] = os.getxattr(path, name, follow_symlinks=False).decode("latin-1")
    return out


@dataclass(frozen=True)
class Blob:
    """Content addressed by its digest: in memory (``data``) or in a file (``path``)."""

    media_type: str
    digest: str
    size: int
    data: bytes | None = None
    path: Path | None = None

    @classmethod
    def of(cls, media_type: str, data: bytes) -> Blob:
        return cls(media_type, "sha256:" + hashlib.sha256(data).hexdigest(), len(data), data)

    def descriptor(self, **extra) -> dict:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size, **extra}

    def read(self) -> bytes:
        return self.data if self.data is not None else self.path.read_bytes()


def _json(data: dict) -> bytes:
    return json.dumps(data, indent=None, separators=(",", ":"), sort_keys=True).encode()


def image(layer: Layer, config: dict) -> tuple[Blob, Blob]:
    """(manifest, config) of a single-layer image; ``config`` without its rootfs."""
    config_blob = Blob.of(MEDIA_CONFIG, _json(
        {**config, "rootfs": {"type": "layers", "diff_ids": [layer.diff_id]}}))
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": config_blob.descriptor(),
        "layers": [{"mediaType": MEDIA_LAYER, "digest": layer.digest, "size": layer.size}],
    }
    return Blob.of(MEDIA_MANIFEST, _json(manifest)), config_blob


def index(manifests: list[tuple[Blob, dict]]) -> Blob:
    """An image index of (manifest, platform) pairs, in the order given."""
    return Blob.of(MEDIA_INDEX, _json({
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": [m.descriptor(platform=platform) for m, platform in manifests],
    }))


def write_archive(target: Path, ref: str, top: Blob, blobs: list[Blob], epoch: int,
                  platform: dict | None = None) -> None:
    """Writes the OCI layout tar whose index.json names ``top`` (a manifest, with its
    ``platform``, or an image index) ``ref``; ``blobs`` are every other blob it reaches."""
    entry = top.descriptor(**({"platform": platform} if platform else {}),
                           annotations={REF_NAME: ref, CONTAINERD_NAME: ref})
    layout = {"schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": [entry]}
    tmp = target.with_name(target.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        def add(name: str, blob: Blob | None = None) -> None:
            info = tarfile.TarInfo(name)
            info.mtime = epoch
            if blob is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
                return
            info.mode, info.size = 0o644, blob.size
            if blob.path is not None:
                with open(blob.path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info, io.BytesIO(blob.data))

        add("oci-layout", Blob.of("", _json({"imageLayoutVersion": "1.0.0"})))
        add("index.json", Blob.of("", _json(layout)))
        add("blobs")
        add("blobs/sha256")
        unique = {b.digest: b for b in [top, *blobs]}
        for digest in sorted(unique):
            add("blobs/sha256/" + digest.split(":", 1)[1], unique[digest])
    os.replace(tmp, target)


@dataclass(frozen=True)
class Image:
    """One platform's image read back from an archive."""

    platform: dict
    manifest_digest: str
    manifest: dict
    config: dict
    layer_digest: str


@dataclass(frozen=True)
class Archive:
    path: Path
    layout: dict  # index.json
    top: dict  # what index.json names: an image index or a manifest
    images: list[Image]

    def image(self, arch: str) -> Image:
        (found,) = [i for i in self.images if i.platform["architecture"] == arch]
        return found

    def members(self, image: Image) -> list[tarfile.TarInfo]:
        with tarfile.open(self.path) as tar:
            layer = tar.extractfile("blobs/sha256/" + image.layer_digest.split(":", 1)[1])
            with tarfile.open(fileobj=layer, mode="r|gz") as members:
                return list(members)

    def files(self, image: Image, wanted) -> dict[str, tuple[tarfile.TarInfo, bytes]]:
        """The layer's regular files for which ``wanted(member)`` is true, with contents."""
        out = {}
        with tarfile.open(self.path) as tar:
            layer = tar.extractfile("blobs/sha256/" + image.layer_digest.split(":", 1)[1])
            with tarfile.open(fileobj=layer, mode="r|gz") as members:
                for member in members:
                    if member.isreg() and wanted(member):
                        out[member.name] = (member, members.extractfile(member).read())
        return out


def read_archive(path: Path) -> Archive:
    """An archive as write_archive lays it out, for checks."""
    with tarfile.open(path) as tar:
        def blob(digest: str) -> dict:
            return json.loads(tar.extractfile("blobs/sha256/" + digest.split(":", 1)[1]).read())

        layout = json.loads(tar.extractfile("index.json").read())
        (entry,) = layout["manifests"]
        top = blob(entry["digest"])
        if entry["mediaType"] == MEDIA_INDEX:
            refs = [(m["digest"], m["platform"]) for m in top["manifests"]]
        else:
            refs = [(entry["digest"], entry["platform"])]
        images = []
        for digest, platform in refs:
            manifest = blob(digest)
            (layer,) = manifest["layers"]
            images.append(Image(platform, digest, manifest, blob(manifest["config"]["digest"]),
                                layer["digest"]))
    return Archive(path, layout, top, images)


def layer_listing(path: Path) -> dict[str, tuple]:
    """Every member of a gzip'd layer tar with what decides its bytes (content by hash),
    to say where two layers that should be equal differ."""
    out = {}
    with tarfile.open(path, mode="r|gz") as tar:
        for m in tar:
            content = hashlib.sha256(tar.extractfile(m).read()).hexdigest()[:16] if m.isreg() else ""
            out[m.name] = (m.type, oct(m.mode), m.uid, m.gid, m.size, m.mtime, m.linkname,
                           content, tuple(sorted(m.pax_headers.items())))
    return out
