"""Kata's own published guest artifacts, installed as Kata pushes them.

What Kata publishes (Kata 4.1.0, tag commit ddcb1ad8): each component its release builds,
the guest kernel and images included, is a ``kata-static-<target>.tar.zst`` (zstd tar of the
``opt/kata/...`` tree it installs; kata-deploy-binaries.sh lines 1883, 2013) that CI pushes
with ``oras push`` to ``ghcr.io/kata-containers/cached-artefacts/<target>:<tags>`` beside
``<target>-version``, ``<target>-builder-image-version`` and ``<target>-sha256sum``
(``sha256sum`` of the tarball; same file, lines 2063-2065, 2105-2132). oras 1.2 gives each file the
layer media type ``application/vnd.oci.image.layer.v1.tar`` and its name as the title, and
packs an OCI image manifest with ``artifactType`` ``application/vnd.unknown.artifact.v1`` and
the empty config (oras cmd/oras/root/push.go lines 61, 133-136; oras-go pack.go).

A guest image target (``rootfs-image-nvidia``, ``rootfs-image-nvidia-gpu-extension``, ...)
holds, under ``opt/kata/share/kata-containers/``, the image ``kata-<os>-<version>-<variant>.image``,
the link ``kata-containers-<variant>.img`` to it (``kata-containers.img`` for the base image)
and, when built measured, ``root_hash_<variant>.txt`` (``root_hash_base.txt`` for the base):
one line of ``kernel_verity_params`` as Kata's image builder prints it from ``veritysetup
format`` (tools/packaging/guest-image/build_image.sh lines 41-42, 85, 100-117, 200-207;
tools/osbuilder/image-builder/image_builder.sh lines 464-518; the ``base`` label:
kata-deploy-binaries.sh lines 686-691).

So a layer titled ``kata-static-<target>.tar.zst`` is checked against its ``-sha256sum``
file, its guest files are written beside it in the staging dir, and each image with a
``root_hash_<variant>.txt`` gets its dm-verity root hash recomputed before the install is
swapped in.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path, PurePosixPath

from .errors import ArtifactError
from .manifest import DEFAULT_MAX_LAYER_BYTES, Manifest, check_file_name

TARBALL = re.compile(r"^kata-static-(?P<target>[A-Za-z0-9._-]+)\.tar\.zst$")
GUEST_DIR = PurePosixPath("opt/kata/share/kata-containers")
ROOT_HASH = re.compile(r"^root_hash_(?P<variant>[A-Za-z0-9._-]+)\.txt$")
CHUNK = 1024 * 1024


def image_of(variant: str) -> str:
    """The link Kata's configs name for a measured variant's image."""
    return "kata-containers.img" if variant == "base" else f"kata-containers-{variant}.img"


def tarballs(manifest: Manifest) -> list[tuple[str, str]]:
    """(layer title, target) of each Kata component tarball in the manifest (not a kernel's
    ``-modules`` tarball: the guest's modules are inside its image already)."""
    found = []
    for layer in manifest.layers:
        match = TARBALL.match(layer.name)
        if match and not match["target"].endswith("-modules"):
            found.append((layer.name, match["target"]))
    return found


def unpack(staging: Path, manifest: Manifest, ref: str) -> dict[str, tuple[str, str]]:
    """Write the guest files of each Kata component tarball into ``staging``; file name (link
    and image both) -> the ``kernel_verity_params`` its ``root_hash_<variant>.txt`` names, and
    where they come from."""
    names = {layer.name for layer in manifest.layers}
    params: dict[str, tuple[str, str]] = {}
    for title, target in tarballs(manifest):
        tarball = staging / title
        _check_sum(staging, tarball, target, ref, manifest)
        written = _extract(tarball, staging, names, ref)
        names |= set(written)
        for name in written:
            match = ROOT_HASH.match(name)
            if not match:
                continue
            line = (staging / name).read_text(errors="replace").strip()
            link = image_of(match["variant"])
            if not (staging / link).is_file():
                raise ArtifactError(f"{ref}: {title} has {name} but no {link}, the image it belongs to; "
                                    "push the tarball as Kata's build makes it")
            found = (line, f"{link}, dm-verity parameters from {name} in {title}")
            params[link] = params[(staging / link).resolve().name] = found
    return params


def _check_sum(staging: Path, tarball: Path, target: str, ref: str, manifest: Manifest) -> None:
    sums = staging / f"{target}-sha256sum"
    if not sums.is_file():
        return  # the layer's own digest was checked as it streamed
    fields = sums.read_text(errors="replace").split()
    digest = next(layer.digest for layer in manifest.layers if layer.name == tarball.name)
    if not fields or f"sha256:{fields[0].lower()}" != digest:
        raise ArtifactError(f"{ref}: {sums.name} names sha256 {fields[0] if fields else '(nothing)'}, but "
                            f"{tarball.name} is {digest}; the two files come from different builds, re-push them")


def _extract(tarball: Path, staging: Path, taken: set[str], ref: str) -> list[str]:
    """The guest dir's regular files and links within it, written into ``staging``."""
    zstd = shutil.which("zstd")
    if zstd is None:
        raise ArtifactError(f"{ref}: {tarball.name} is zstd-compressed (Kata's kata-static tarballs) and this "
                            "node has no zstd program; install zstd (Debian's zstd package)")
    written: list[str] = []
    with subprocess.Popen([zstd, "-dcq", "--", str(tarball)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as proc:
        try:
            with tarfile.open(fileobj=proc.stdout, mode="r|") as archive:
                for member in archive:
                    name = _guest_name(member.name)
                    if name is None:
                        continue
                    if name in taken or name in written:
                        raise ArtifactError(f"{ref}: {tarball.name} holds {name!r}, which another layer or "
                                            "member already gave; refusing the artifact")
                    check_file_name(name, ref, tarball.name)
                    if member.isfile():
                        _write(archive, member, staging / name, ref, tarball.name)
                    elif member.issym() and "/" not in member.linkname and member.linkname not in ("", ".", ".."):
                        os.symlink(member.linkname, staging / name)  # kata-containers-<variant>.img
                    else:
                        continue  # directories, and nothing that could point outside the dir
                    written.append(name)
            while proc.stdout.read(CHUNK):
                pass  # the archive's end padding: zstd finishes writing, and its exit status says all was read
        except tarfile.TarError as exc:
            raise ArtifactError(f"{ref}: {tarball.name} is not a zstd tar archive ({exc}); re-push it as "
                                "Kata's build makes it") from exc
        finally:
            proc.stdout.close()
            error = proc.stderr.read().decode(errors="replace").strip()
        if proc.wait() != 0:
            raise ArtifactError(f"{ref}: zstd could not decompress {tarball.name} ({error}); re-push it")
    return written


def _guest_name(member: str) -> str | None:
    path = PurePosixPath(member.removeprefix("./"))
    return path.name if path.parent == GUEST_DIR else None


def _write(archive: tarfile.TarFile, member: tarfile.TarInfo, target: Path, ref: str, title: str) -> None:
    if member.size > DEFAULT_MAX_LAYER_BYTES:
        raise ArtifactError(f"{ref}: {title} holds {member.name} of {member.size} bytes, over katamgr's "
                            f"{DEFAULT_MAX_LAYER_BYTES}-byte cap on one file; check the ref")
    source = archive.extractfile(member)
    with target.open("xb") as out:
        while chunk := source.read(CHUNK):
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    os.chmod(target, 0o644)

