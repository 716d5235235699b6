"""Kata's own guest artifacts, pulled unchanged from a mirror of Kata's registry or an OCI layout.

The artifacts are shaped as Kata 4.1.0's CI pushes them (tag commit ddcb1ad8): one per build
target, ``oras push <registry>/<repository>/cached-artefacts/<target>:<tags>`` of
``kata-static-<target>.tar.zst``, ``<target>-version``, ``<target>-builder-image-version`` and
``<target>-sha256sum`` (tools/packaging/kata-deploy/local-build/kata-deploy-binaries.sh
lines 2063-2065 write the three small files, 2105-2111 list the files and the reference,
2132 pushes; the tarball is ``tar`` of the ``kata-static`` tree, line 2013). oras 1.2.0 (the
version Kata installs: dockerbuild/install_oras.sh line 18) packs an OCI image manifest with
``artifactType`` ``application/vnd.unknown.artifact.v1`` and the empty config, each file a
``application/vnd.oci.image.layer.v1.tar`` layer titled with its name, and an
``org.opencontainers.image.created`` annotation (oras cmd/oras/root/push.go lines 61, 133-136;
oras-go v2 pack.go ``packManifestV1_1_RC4``). Inside the tarball, under
``opt/kata/share/kata-containers/``: the image ``kata-<os>-<version>-<variant>.image``, the link
``kata-containers-<variant>.img`` and ``root_hash_<variant>.txt``, one ``kernel_verity_params``
line (tools/packaging/guest-image/build_image.sh lines 100-117, 200-207; the NVIDIA extension's
image name ends in the driver version, lines 100-108;
tools/osbuilder/image-builder/image_builder.sh lines 490-518). The images and their trees are
made by cryptsetup's ``veritysetup format`` (support.veritykit), the tarballs by GNU tar and zstd.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from artifactkit import leftovers, snapshot
from support.veritykit import VERITYSETUP, guest_image

from gpunode.host.root import HostRoot
from katamgr.artifacts import ArtifactError, install_artifact
from katamgr.runtime.guest_images import PARAMS_FILE, GuestCheck, annotated_params
from katamgr.runtime.kata_config import transform_kata_config

if VERITYSETUP is None or shutil.which("zstd") is None:
    if os.environ.get("REQUIRE_INTEGRATION") == "1":
        raise RuntimeError("veritysetup (cryptsetup-bin) or zstd is missing; run .ci/setup")
    pytest.skip("veritysetup or zstd is not installed", allow_module_level=True)

LAYER = "application/vnd.oci.image.layer.v1.tar"  # oras push's default for a file
EMPTY = {"mediaType": "application/vnd.oci.empty.v1+json",
         "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a", "size": 2,
         "data": "e30="}
TAG = "latest-main-x86_64"  # the branch tag, sanitised, with the arch suffix (lines 2078-2103)


def kata_component(workdir: Path, target: str, variant: str, *, blocks: int, driver: str = "",
                   root_hash: str | None = None) -> tuple[list[Path], str]:
    """The four files Kata's build pushes for a measured guest image target; its verity line."""
    tree = workdir / target / "kata-static"
    share = tree / "opt/kata/share/kata-containers"
    share.mkdir(parents=True)
    image = f"kata-ubuntu-noble-{variant}{'-' + driver if driver else ''}.image"
    params = guest_image(share / image, blocks)
    os.symlink(image, share / f"kata-containers-{variant}.img")
    (share / f"root_hash_{variant}.txt").write_text((root_hash or params) + "\n")
    return packed(workdir, target), params


def packed(workdir: Path, target: str) -> list[Path]:
    """The files Kata's build pushes for ``target``, from its ``kata-static`` tree."""
    tree = workdir / target / "kata-static"
    out = workdir / target / "push"
    out.mkdir()
    tarball = out / f"kata-static-{target}.tar.zst"
    subprocess.run(["tar", "--zstd", "-cf", str(tarball), "."], cwd=tree, check=True)
    (out / f"{target}-version").write_text(f"4.1.0-{target}-ddcb1ad8d\n")
    (out / f"{target}-builder-image-version").write_text("\n")
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    (out / f"{target}-sha256sum").write_text(f"{digest}  {tarball.name}\n")
    return [tarball, *(out / f"{target}-{kind}" for kind in ("version", "builder-image-version", "sha256sum"))]


def oras_manifest(files: list[Path]) -> tuple[dict, dict[str, bytes]]:
    blobs = {EMPTY["digest"]: b"{}"}
    layers = []
    for path in files:
        data = path.read_bytes()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        layers.append({"mediaType": LAYER, "digest": digest, "size": len(data),
                       "annotations": {"org.opencontainers.image.title": path.name}})
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "artifactType": "application/vnd.unknown.artifact.v1", "config": EMPTY, "layers": layers,
                "annotations": {"org.opencontainers.image.created": "2026-08-21T12:00:00Z"}}
    return manifest, blobs


def oci_layout(root: Path, files: list[Path]) -> str:
    """``oras copy --to-oci-layout`` of the pushed artifact: the ref to pull it by."""
    manifest, blobs = oras_manifest(files)
    data = json.dumps(manifest, separators=(",", ":")).encode()
    blobs["sha256:" + hashlib.sha256(data).hexdigest()] = data
    (root / "blobs" / "sha256").mkdir(parents=True)
    for digest, content in blobs.items():
        (root / "blobs" / "sha256" / digest.split(":")[1]).write_bytes(content)
    entry = {"mediaType": manifest["mediaType"], "digest": "sha256:" + hashlib.sha256(data).hexdigest(),
             "size": len(data), "artifactType": manifest["artifactType"],
             "annotations": {"org.opencontainers.image.ref.name": TAG}}
    (root / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [entry]}))
    return f"oci-layout://{root}:{TAG}"


def push(registry, repository: str, files: list[Path], workdir: Path) -> str:
    """The same artifact pushed to the real registry, as a mirror of ghcr.io would serve it."""
    client = registry.client()
    container = client.get_container(f"{registry.host}/{repository}:{TAG}")
    manifest, blobs = oras_manifest(files)
    for digest, content in blobs.items():
        blob = workdir / digest.split(":")[1]
        blob.write_bytes(content)
        client._check_200_response(client.upload_blob(str(blob), container, {"digest": digest, "size": len(content)}))
    client._check_200_response(client.upload_manifest(manifest, container))
    return f"{registry.host}/{repository}:{TAG}"


def test_kata_published_base_image_installs_verified_from_a_mirror_and_again_transfers_nothing(registry_server,
                                                                                               tmp_path):
    files, params = kata_component(tmp_path, "rootfs-image-nvidia", "nvidia", blocks=300)
    ref = push(registry_server, "kata-containers/cached-artefacts/rootfs-image-nvidia", files, tmp_path)
    dest = tmp_path / "classes" / "kata-qemu-nvidia-gpu"
    first = install_artifact(ref, dest, check=GuestCheck(), retries=0)
    assert first.changed
    link = dest / "kata-containers-nvidia.img"
    assert link.is_symlink() and os.readlink(link) == "kata-ubuntu-noble-nvidia.image"
    assert link.read_bytes() == (tmp_path / "rootfs-image-nvidia/kata-static/opt/kata/share/kata-containers"
                                 / "kata-ubuntu-noble-nvidia.image").read_bytes()
    # the parameters Kata's image builder wrote, kept for the rendered config
    assert annotated_params(dest)["kata-containers-nvidia.img"] == params
    again = install_artifact(ref, dest, check=GuestCheck(), retries=0)
    assert (again.changed, again.bytes_transferred) == (False, 0)


def test_kata_published_extension_from_an_oci_layout_is_checked_against_its_root_hash_file(tmp_path):
    files, params = kata_component(tmp_path, "rootfs-image-nvidia-gpu-extension", "nvidia-gpu-extension",
                                   blocks=40, driver="590.48.01")
    dest = tmp_path / "classes" / "kata-qemu-nvidia-gpu"
    install_artifact(oci_layout(tmp_path / "layout", files), dest, check=GuestCheck())
    assert json.loads((dest / PARAMS_FILE).read_text())["kata-containers-nvidia-gpu-extension.img"] == params
    assert (dest / "kata-ubuntu-noble-nvidia-gpu-extension-590.48.01.image").is_file()


def test_an_image_that_is_not_the_one_its_root_hash_file_names_is_refused_and_nothing_changes(tmp_path):
    good, _ = kata_component(tmp_path / "v1", "rootfs-image-nvidia", "nvidia", blocks=40)
    dest = tmp_path / "classes" / "kata-qemu-nvidia-gpu"
    install_artifact(oci_layout(tmp_path / "v1" / "layout", good), dest, check=GuestCheck())
    before = snapshot(dest)
    _, other = kata_component(tmp_path / "other", "rootfs-image-nvidia", "nvidia", blocks=40)
    bad, _ = kata_component(tmp_path / "v2", "rootfs-image-nvidia", "nvidia", blocks=40, root_hash=other)
    with pytest.raises(ArtifactError, match="kata-containers-nvidia.img.*root_hash_.*dm-verity root hash"):
        install_artifact(oci_layout(tmp_path / "v2" / "layout", bad), dest, check=GuestCheck())
    assert snapshot(dest) == before and leftovers(dest) == []


def test_a_sha256sum_file_from_another_build_is_refused(tmp_path):
    files, _ = kata_component(tmp_path, "rootfs-image-nvidia", "nvidia", blocks=8)
    files[3].write_text("ab" * 32 + "  kata-static-rootfs-image-nvidia.tar.zst\n")
    dest = tmp_path / "classes" / "kata-qemu-nvidia-gpu"
    with pytest.raises(ArtifactError, match="rootfs-image-nvidia-sha256sum names sha256 abab"):
        install_artifact(oci_layout(tmp_path / "layout", files), dest, check=GuestCheck())
    assert not dest.exists() and leftovers(dest) == []


def test_kata_tarballs_pushed_together_with_a_config_render_the_parameters_of_its_root_hash_file(tmp_path):
    """Kata's unchanged tarballs of a kernel and a measured image, pushed as one artifact with the
    class's Kata config, which names the links as Kata 4.1's configuration-qemu-nvidia-gpu.toml.in
    does (``kernel``/``image`` lines 16-17; ``vmlinuz-nvidia-gpu.container`` and
    ``kata-containers-nvidia-gpu.img``: src/runtime/Makefile lines 66, 963-965;
    tools/packaging/kernel/build-kernel.sh lines 576-622) and leaves the parameters out."""
    share = tmp_path / "kernel-nvidia-gpu" / "kata-static" / "opt/kata/share/kata-containers"
    share.mkdir(parents=True)
    (share / "vmlinuz-6.12.47-172-nvidia-gpu").write_bytes(b"MZ" + os.urandom(64))
    os.symlink("vmlinuz-6.12.47-172-nvidia-gpu", share / "vmlinuz-nvidia-gpu.container")
    kernel = packed(tmp_path, "kernel-nvidia-gpu")
    image, params = kata_component(tmp_path, "rootfs-image-nvidia-gpu", "nvidia-gpu", blocks=40, driver="590.48.01")
    config = tmp_path / "configuration-qemu-nvidia-gpu.toml"
    config.write_text("""[hypervisor.qemu]
kernel = "/opt/kata/share/kata-containers/vmlinuz-nvidia-gpu.container"
image = "/opt/kata/share/kata-containers/kata-containers-nvidia-gpu.img"
rootfs_type = "erofs"
kernel_verity_params = ""
""")
    host = HostRoot.at(tmp_path / "root")
    dest = host.path("/opt/kata-classes/kata-qemu-nvidia-gpu")
    install_artifact(oci_layout(tmp_path / "layout", [*kernel, *image, config]), dest, check=GuestCheck())
    transform_kata_config(host, dest)
    rendered = (dest / "rendered" / config.name).read_text()
    assert f'kernel_verity_params = "{params}"' in rendered
    assert 'image = "/opt/kata-classes/kata-qemu-nvidia-gpu/kata-containers-nvidia-gpu.img"' in rendered
    assert 'kernel = "/opt/kata-classes/kata-qemu-nvidia-gpu/vmlinuz-nvidia-gpu.container"' in rendered


def test_a_tarball_link_out_of_its_dir_is_not_installed_and_its_root_hash_file_names_the_missing_image(tmp_path):
    share = tmp_path / "rootfs-image-nvidia" / "kata-static" / "opt/kata/share/kata-containers"
    share.mkdir(parents=True)
    os.symlink("/etc/passwd", share / "kata-containers-nvidia.img")
    os.symlink("../../../../../etc/shadow", share / "kata-ubuntu-noble-nvidia.image")
    (share / "root_hash_nvidia.txt").write_text("root_hash=" + "ab" * 32 + ",salt=01,data_blocks=8,"
                                                 "data_block_size=4096,hash_block_size=4096\n")
    files = packed(tmp_path, "rootfs-image-nvidia")
    dest = tmp_path / "classes" / "kata-qemu-nvidia-gpu"
    with pytest.raises(ArtifactError, match="has root_hash_nvidia.txt but no kata-containers-nvidia.img"):
        install_artifact(oci_layout(tmp_path / "layout", files), dest, check=GuestCheck())
    assert not dest.exists() and leftovers(dest) == []
