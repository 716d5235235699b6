"""OCI image layouts, written with the standard library only (hack/image/build).

A single-layer image as a tar archive of an OCI image layout (image-spec v1.1):

    oci-layout                 {"imageLayoutVersion": "1.0.0"}
    index.json                 one manifest, named by the annotations
                               org.opencontainers.image.ref.name and io.containerd.image.name
    blobs/sha256/<hex>         the manifest, the config and the layer (a gzip'd tar)

The layer lists a root filesystem directory depth first in name order, every mtime
clamped to SOURCE_DATE_EPOCH, numeric owners only, the gzip header without a name or a
time, so the same tree gives the same bytes. `ctr images import` (containerd 1.6 and 2.x)
names the image from io.containerd.image.name; tools that read the OCI annotation
(skopeo's oci-archive:, crane) from org.opencontainers.image.ref.name.
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


def _blob(data: dict) -> bytes:
    return json.dumps(data, indent=None, separators=(",", ":"), sort_keys=True).encode()


def write_archive(target: Path, ref: str, layer: Layer, config: dict, epoch: int,
                  annotations: dict[str, str] | None = None) -> dict[str, str]:
    """Writes the OCI layout tar for one single-layer amd64 image to ``target``; returns
    the digests of its manifest and config."""
    config = {**config, "rootfs": {"type": "layers", "diff_ids": [layer.diff_id]}}
    config_blob = _blob(config)
    config_digest = "sha256:" + hashlib.sha256(config_blob).hexdigest()
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {"mediaType": MEDIA_CONFIG, "digest": config_digest, "size": len(config_blob)},
        "layers": [{"mediaType": MEDIA_LAYER, "digest": layer.digest, "size": layer.size}],
    }
    if annotations:
        manifest["annotations"] = annotations
    manifest_blob = _blob(manifest)
    manifest_digest = "sha256:" + hashlib.sha256(manifest_blob).hexdigest()
    index = {
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": [{
            "mediaType": MEDIA_MANIFEST,
            "digest": manifest_digest,
            "size": len(manifest_blob),
            "platform": {"architecture": config["architecture"], "os": config["os"]},
            "annotations": {REF_NAME: ref, CONTAINERD_NAME: ref},
        }],
    }
    tmp = target.with_name(target.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        def add(name: str, data: bytes | None = None, path: Path | None = None) -> None:
            info = tarfile.TarInfo(name)
            info.mtime = epoch
            if data is None and path is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
                return
            info.mode = 0o644
            if path is not None:
                info.size = path.stat().st_size
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

        add("oci-layout", _blob({"imageLayoutVersion": "1.0.0"}))
        add("index.json", _blob(index))
        add("blobs")
        add("blobs/sha256")
        blobs = {config_digest: config_blob, manifest_digest: manifest_blob, layer.digest: None}
        for digest in sorted(blobs):
            name = "blobs/sha256/" + digest.split(":", 1)[1]
            if blobs[digest] is None:
                add(name, path=layer.path)
            else:
                add(name, blobs[digest])
    os.replace(tmp, target)
    return {"manifest": manifest_digest, "config": config_digest}


def read_archive(path: Path) -> tuple[dict, dict, dict, list[tarfile.TarInfo]]:
    """(index, manifest, config, layer members) of a single-layer archive, for checks."""
    with tarfile.open(path) as tar:
        def blob(digest: str) -> bytes:
            return tar.extractfile("blobs/sha256/" + digest.split(":", 1)[1]).read()

        index = json.loads(tar.extractfile("index.json").read())
        manifest = json.loads(blob(index["manifests"][0]["digest"]))
        config = json.loads(blob(manifest["config"]["digest"]))
        layer = tar.extractfile("blobs/sha256/" + manifest["layers"][0]["digest"].split(":", 1)[1])
        with tarfile.open(fileobj=layer, mode="r|gz") as members:
            listed = list(members)
    return index, manifest, config, listed
