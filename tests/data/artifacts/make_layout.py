"""Build the example OCI image layout (examples/oci-layout) deterministically.

Two tags, each one artifact manifest whose layers are plain files named by their
``org.opencontainers.image.title`` annotation:
- ``kata-qemu-nvidia-gpu``: vmlinux-nvidia-gpu, kata-ubuntu-jammy-nvidia-gpu.initrd,
  configuration-qemu-nvidia-gpu.toml
- ``kata-qemu-nvidia-gpu-snp``: the same kernel and initrd blobs,
  configuration-qemu-nvidia-gpu-snp.toml
The kernel and initrd are small fakes (not bootable); the Kata configs are real-shaped.

Run ``python tests/data/artifacts/make_layout.py [DEST]`` to rebuild (default: the
shipped examples/oci-layout); tests check the shipped copy equals a fresh build.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
SHIPPED = REPO / "examples" / "oci-layout"
FILES = HERE / "files"

ARTIFACT_MEDIA_TYPE = "application/vnd.kata-containers.artifact.v1"
ARTIFACT_TYPE = "application/vnd.kata-containers.runtimeclass.v1"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
EMPTY_MEDIA_TYPE = "application/vnd.oci.empty.v1+json"
TITLE = "org.opencontainers.image.title"
REF_NAME = "org.opencontainers.image.ref.name"

KERNEL = "vmlinux-nvidia-gpu"
INITRD = "kata-ubuntu-jammy-nvidia-gpu.initrd"
TAGS = {
    "kata-qemu-nvidia-gpu": [KERNEL, INITRD, "configuration-qemu-nvidia-gpu.toml"],
    "kata-qemu-nvidia-gpu-snp": [KERNEL, INITRD, "configuration-qemu-nvidia-gpu-snp.toml"],
}


def fake_kernel() -> bytes:
    header = b"\x7fELF\x02\x01\x01\x00" + bytes(8)
    text = b"katamgr example: fake Kata guest kernel for NVIDIA GPU passthrough; not bootable.\n"
    return header + text * 24


def fake_initrd() -> bytes:
    # starts like a newc cpio archive, which is what a real initrd is
    text = b"katamgr example: fake Kata guest initrd (Ubuntu jammy, NVIDIA GPU); not bootable.\n"
    return b"070701" + b"0" * 104 + text * 24


def file_content(name: str) -> bytes:
    if name == KERNEL:
        return fake_kernel()
    if name == INITRD:
        return fake_initrd()
    return (FILES / name).read_bytes()


def _json(value: object) -> bytes:
    return json.dumps(value, indent=2, sort_keys=True).encode() + b"\n"


def _put(blobs: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def build_layout(dest: Path) -> dict[str, str]:
    """Write the layout into ``dest`` (replacing it); return tag -> manifest digest."""
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    (dest / "oci-layout").write_bytes(_json({"imageLayoutVersion": "1.0.0"}))
    config = {"mediaType": EMPTY_MEDIA_TYPE, **_put(blobs, b"{}")}
    entries, digests = [], {}
    for tag, names in TAGS.items():
        layers = [
            {"mediaType": ARTIFACT_MEDIA_TYPE, **_put(blobs, file_content(name)),
             "annotations": {TITLE: name}}
            for name in names
        ]
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "artifactType": ARTIFACT_TYPE,
            "config": config,
            "layers": layers,
            "annotations": {"org.opencontainers.image.description":
                            f"Kata guest kernel, initrd and config for runtime class {tag}"},
        }
        descriptor = _put(blobs, _json(manifest))
        digests[tag] = descriptor["digest"]
        entries.append({"mediaType": MANIFEST_MEDIA_TYPE, **descriptor,
                        "artifactType": ARTIFACT_TYPE, "annotations": {REF_NAME: tag}})
    index = {"schemaVersion": 2, "mediaType": INDEX_MEDIA_TYPE, "manifests": entries}
    (dest / "index.json").write_bytes(_json(index))
    return digests


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else SHIPPED
    for tag, digest in build_layout(target).items():
        print(f"{target}: {tag} -> {digest}")
