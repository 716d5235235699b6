"""Kata 4.x guest images: each one's dm-verity root hash checked before it is installed.

The images are built the way Kata's image builder lays them out, their hash trees and root
hashes made by cryptsetup's ``veritysetup format``, not by our code (support.veritykit).
Pulled from a real registry (docker-registry) and from an OCI layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest
from artifactkit import leftovers, snapshot
from support.veritykit import SECTOR, START, VERITYSETUP, guest_image

from gpunode.host.root import HostRoot
from katamgr.artifacts import ArtifactError, install_artifact
from katamgr.runtime.guest_images import GuestCheck, verify_staged
from katamgr.runtime.kata_config import transform_kata_config

if VERITYSETUP is None:
    if os.environ.get("REQUIRE_INTEGRATION") == "1":
        raise RuntimeError("veritysetup (Debian's cryptsetup-bin) is missing; run .ci/setup")
    pytest.skip("veritysetup (Debian's cryptsetup-bin) is not installed", allow_module_level=True)

KERNEL = "vmlinux-nvidia-gpu"
BASE = "kata-containers-nvidia.img"
GPU = "kata-containers-nvidia-gpu-extension.img"
CONFIG = "configuration-qemu-nvidia-gpu.toml"


def kata_config(base_params: str, gpu_params: str) -> str:
    return f'''# Kata 4.1 NVIDIA GPU guest, as configuration-qemu-nvidia-gpu.toml.in shapes it
[hypervisor.qemu]
path = "/opt/kata/bin/qemu-system-x86_64"
kernel = "/opt/kata/share/kata-containers/{KERNEL}"
image = "/opt/kata/share/kata-containers/{BASE}"
rootfs_type = "erofs"
# Optional dm-verity parameters (comma-separated key=value list)
kernel_verity_params = "{base_params}"
cold_plug_vfio = "root-port"

# the GPU userspace, its own EROFS image
[[hypervisor.qemu.guest_extension_images]]
name = "nvidia-gpu"
path = "/opt/kata/share/kata-containers/{GPU}"
verity_params = "{gpu_params}"
'''


def artifact(workdir: Path, *, blocks: int = 40) -> tuple[list[Path], str, str]:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / KERNEL).write_bytes(b"\x7fELF" + os.urandom(64))
    base = guest_image(workdir / BASE, blocks)
    gpu = guest_image(workdir / GPU, 300)  # over one hash block: a two-level tree
    (workdir / CONFIG).write_text(kata_config(base, gpu))
    return [workdir / n for n in (KERNEL, BASE, GPU, CONFIG)], base, gpu


def flip_data_byte(image: Path) -> None:
    with image.open("r+b") as disk:
        disk.seek(START * SECTOR + 5000)
        byte = disk.read(1)
        disk.seek(START * SECTOR + 5000)
        disk.write(bytes([byte[0] ^ 1]))


def test_verified_images_install_hashed_as_they_stream_and_a_second_pull_transfers_nothing(registry_server, tmp_path):
    files, _, _ = artifact(tmp_path / "v1")
    registry_server.push_files("kata/erofs:v1", files)
    dest = tmp_path / "classes" / "kata-qemu-nvidia-gpu"
    ref = f"{registry_server.host}/kata/erofs:v1"
    check = GuestCheck()
    first = install_artifact(ref, dest, check=check, retries=1, backoff=0.01)
    assert first.changed and sorted(first.files) == sorted(p.name for p in files)
    # Both images were hashed as they streamed (the config came first), no second pass.
    assert {name: len(check.streams[name].digests) for name in (BASE, GPU)} == {BASE: 40, GPU: 300}
    assert (dest / BASE).read_bytes() == (tmp_path / "v1" / BASE).read_bytes()
    again = install_artifact(ref, dest, check=verify_staged, retries=1, backoff=0.01)
    assert (again.changed, again.bytes_transferred) == (False, 0)


def test_an_image_whose_root_hash_differs_is_refused_and_nothing_changes(registry_server, tmp_path):
    files, _, _ = artifact(tmp_path / "v1")
    registry_server.push_files("kata/tampered:v1", files)
    dest = tmp_path / "classes" / "kata-qemu-nvidia-gpu"
    install_artifact(f"{registry_server.host}/kata/tampered:v1", dest, check=verify_staged)
    before = snapshot(dest)
    files2, _, gpu = artifact(tmp_path / "v2")
    flip_data_byte(tmp_path / "v2" / GPU)  # the extension no longer matches its parameters
    registry_server.push_files("kata/tampered:v2", files2)
    check = GuestCheck()
    with pytest.raises(ArtifactError) as refused:
        install_artifact(f"{registry_server.host}/kata/tampered:v2", dest, check=check, retries=0)
    assert len(check.streams[GPU].digests) == 300  # judged from the streamed blocks
    message = str(refused.value)
    assert "guest_extension_images nvidia-gpu" in message and GPU in message
    assert gpu.split(",")[0].split("=")[1] in message  # the root hash it should have had
    assert snapshot(dest) == before and leftovers(dest) == []


def test_an_erofs_image_without_verity_parameters_is_refused(registry_server, tmp_path):
    files, base, _ = artifact(tmp_path / "v1")
    config = tmp_path / "v1" / CONFIG
    config.write_text(config.read_text().replace(f'kernel_verity_params = "{base}"', 'kernel_verity_params = ""'))
    registry_server.push_files("kata/unverified:v1", files)
    dest = tmp_path / "classes" / "kata-qemu-nvidia-gpu"
    with pytest.raises(ArtifactError, match="no dm-verity parameters"):
        install_artifact(f"{registry_server.host}/kata/unverified:v1", dest, check=verify_staged, retries=0)
    assert not dest.exists() and leftovers(dest) == []


def _layout(root: Path, files: list[Path], annotations: dict[str, dict[str, str]]) -> None:
    """An OCI image layout of one artifact manifest; ``annotations`` extra per file name."""
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    layers = [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **put(p.read_bytes()),
               "annotations": {"org.opencontainers.image.title": p.name, **annotations.get(p.name, {})}}
              for p in files]
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.empty.v1+json", **put(b"{}")},
                           "layers": layers}).encode()
    entry = {"mediaType": "application/vnd.oci.image.manifest.v1+json", **put(manifest),
             "annotations": {"org.opencontainers.image.ref.name": "v1"}}
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [entry]}))


def test_parameters_from_the_layer_annotation_are_checked_and_rendered(tmp_path):
    files, base, gpu = artifact(tmp_path / "src")
    config = tmp_path / "src" / CONFIG
    config.write_text(config.read_text().replace(f'"{base}"', '""').replace(f'"{gpu}"', '""'))
    _layout(tmp_path / "layout", files, {BASE: {"kata-sandbox-manager.io/verity-params": base},
                                         GPU: {"kata-sandbox-manager.io/verity-params": gpu}})
    host = HostRoot.at(tmp_path / "root")
    dest = host.path("/opt/kata-classes/kata-qemu-nvidia-gpu")
    install_artifact(f"oci-layout://{tmp_path / 'layout'}:v1", dest, check=verify_staged)
    result = transform_kata_config(host, dest)
    rendered = (dest / "rendered" / CONFIG).read_text()
    assert f'kernel_verity_params = "{base}"' in rendered
    assert f'verity_params = "{gpu}"' in rendered
    assert f'path = "/opt/kata-classes/kata-qemu-nvidia-gpu/{GPU}"' in rendered
    assert "# the GPU userspace, its own EROFS image" in rendered  # comments kept
    assert any("guest_extension_images nvidia-gpu.path" in c for c in result.changes)


def test_a_running_vm_keeps_the_image_it_booted_across_an_update(registry_server, tmp_path):
    files, _, _ = artifact(tmp_path / "v1")
    registry_server.push_files("kata/running:v1", files)
    dest = tmp_path / "classes" / "kata-qemu-nvidia-gpu"
    install_artifact(f"{registry_server.host}/kata/running:v1", dest, check=verify_staged)
    booted = (dest / BASE).read_bytes()
    with (dest / BASE).open("rb") as qemu:  # QEMU holds the image open for the VM's life
        files2, _, _ = artifact(tmp_path / "v2")
        registry_server.push_files("kata/running:v2", files2)
        assert install_artifact(f"{registry_server.host}/kata/running:v2", dest, check=verify_staged).changed
        assert qemu.read() == booted
    assert (dest / BASE).read_bytes() == (tmp_path / "v2" / BASE).read_bytes() != booted


@pytest.mark.parametrize(("params", "said"), [
    ("root_hash=" + "ab" * 32 + ",salt=01,data_blocks=8,data_block_size=4096", "lack hash_block_size"),
    ("root_hash=" + "ab" * 32 + ",salt=01,data_blocks=8,data_block_size=1000,hash_block_size=4096",
     "data_block_size=1000 must be non-zero and a multiple of 512"),
    ("root_hash=" + "ab" * 32 + ",salt=01,data_blocks=0,data_block_size=4096,hash_block_size=4096",
     "data_blocks=0 must be non-zero"),
    ("root_hash,salt=01", "'root_hash' is not key=value"),
])
def test_parameters_kata_refuses_are_refused_by_name(tmp_path, params, said):
    """Kata 4.1's ParseKernelVerityParams rules (virtcontainers/hypervisor.go): every field, sizes
    non-zero multiples of 512; the image is not installed."""
    files, base, _ = artifact(tmp_path / "v1")
    config = tmp_path / "v1" / CONFIG
    config.write_text(config.read_text().replace(base, params))
    _layout(tmp_path / "layout", files, {})
    dest = tmp_path / "classes" / "kata-qemu-nvidia-gpu"
    with pytest.raises(ArtifactError, match=re.escape(said)):
        install_artifact(f"oci-layout://{tmp_path / 'layout'}:v1", dest, check=verify_staged)
    assert not dest.exists()


def test_an_image_without_a_partition_table_is_refused(tmp_path):
    files, base, _ = artifact(tmp_path / "v1")
    image = tmp_path / "v1" / BASE
    image.write_bytes(image.read_bytes()[START * SECTOR:])  # the bare data and tree, no MBR
    _layout(tmp_path / "layout", files, {})
    dest = tmp_path / "classes" / "kata-qemu-nvidia-gpu"
    with pytest.raises(ArtifactError, match="has 0 MBR partition"):
        install_artifact(f"oci-layout://{tmp_path / 'layout'}:v1", dest, check=verify_staged)



def test_a_gpt_disk_is_refused_by_name(tmp_path):
    files, base, _ = artifact(tmp_path / "v1")
    image = tmp_path / "v1" / BASE
    disk = bytearray(image.read_bytes())
    disk[446:462] = bytes([0, 0, 2, 0, 0xEE, 0xFF, 0xFF, 0xFF, 1, 0, 0, 0, 0xFF, 0xFF, 0, 0])  # protective MBR
    disk[462:510] = bytes(48)
    image.write_bytes(bytes(disk))
    _layout(tmp_path / "layout", files, {})
    dest = tmp_path / "classes" / "kata-qemu-nvidia-gpu"
    with pytest.raises(ArtifactError, match="is a GPT disk; .*rebuild the image with an MBR table"):
        install_artifact(f"oci-layout://{tmp_path / 'layout'}:v1", dest, check=verify_staged)
    assert not dest.exists()
