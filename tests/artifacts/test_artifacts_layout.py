"""Installing Kata artifacts from an OCI image layout on disk (air-gapped sites, the demo)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import tomllib
from pathlib import Path

import pytest
from artifactkit import leftovers, snapshot
from support.paths import EXAMPLES, REPO

import katamgr.artifacts.swap as swap_module
from katamgr.artifacts import ArtifactError, install_artifact, read_install
from katamgr.artifacts.record import RECORD_NAME

LAYOUT = EXAMPLES / "oci-layout"
GPU_TAG = "kata-qemu-nvidia-gpu"
SNP_TAG = "kata-qemu-nvidia-gpu-snp"
GPU_FILES = ["vmlinux-nvidia-gpu", "kata-ubuntu-jammy-nvidia-gpu.initrd",
             "configuration-qemu-nvidia-gpu.toml"]


def _load_builder():
    path = REPO / "tests" / "data" / "artifacts" / "make_layout.py"
    spec = importlib.util.spec_from_file_location("make_layout", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_layout = _load_builder()


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_shipped_layout_matches_a_fresh_build(tmp_path):
    make_layout.build_layout(tmp_path / "layout")
    assert tree(tmp_path / "layout") == tree(LAYOUT), (
        "examples/oci-layout is stale: run python tests/data/artifacts/make_layout.py"
    )


def test_shipped_kata_configs_have_the_gpu_keys():
    for name in ("configuration-qemu-nvidia-gpu.toml", "configuration-qemu-nvidia-gpu-snp.toml"):
        qemu = tomllib.loads(make_layout.file_content(name).decode())["hypervisor"]["qemu"]
        assert qemu["machine_type"] == "q35"
        assert qemu["cold_plug_vfio"] == "root-port"
        assert qemu["pcie_root_port"] == 0
        assert qemu["kernel"].endswith("/vmlinux-nvidia-gpu")
        assert qemu["initrd"].endswith("/kata-ubuntu-jammy-nvidia-gpu.initrd")


def test_install_by_tag_writes_the_files_and_a_record(tmp_path):
    dest = tmp_path / "runtimeclasses" / GPU_TAG
    result = install_artifact(f"oci-layout://{LAYOUT}:{GPU_TAG}", dest)
    assert result.changed and result.warning is None
    assert result.files == GPU_FILES
    for name in GPU_FILES:
        assert (dest / name).read_bytes() == make_layout.file_content(name)
    assert result.bytes_transferred == sum(len(make_layout.file_content(n)) for n in GPU_FILES)
    record = read_install(dest)
    index = json.loads((LAYOUT / "index.json").read_text())
    tagged = {m["annotations"]["org.opencontainers.image.ref.name"]: m["digest"]
              for m in index["manifests"]}
    assert record.digest == result.digest == tagged[GPU_TAG]
    assert sorted(f.name for f in record.files) == sorted(GPU_FILES)
    assert leftovers(dest) == []


def test_second_install_changes_nothing(tmp_path):
    dest = tmp_path / GPU_TAG
    install_artifact(f"oci-layout://{LAYOUT}:{GPU_TAG}", dest)
    before = snapshot(dest)
    again = install_artifact(f"oci-layout://{LAYOUT}:{GPU_TAG}", dest)
    assert (again.changed, again.bytes_transferred) == (False, 0)
    assert snapshot(dest) == before


def test_snp_tag_by_digest_and_switching_tags(tmp_path):
    index = json.loads((LAYOUT / "index.json").read_text())
    snp = next(m for m in index["manifests"]
               if m["annotations"]["org.opencontainers.image.ref.name"] == SNP_TAG)
    dest = tmp_path / "rc"
    install_artifact(f"oci-layout://{LAYOUT}:{GPU_TAG}", dest)
    result = install_artifact(f"oci-layout://{LAYOUT}@{snp['digest']}", dest)
    assert result.changed and result.digest == snp["digest"]
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        [RECORD_NAME, "vmlinux-nvidia-gpu", "kata-ubuntu-jammy-nvidia-gpu.initrd",
         "configuration-qemu-nvidia-gpu-snp.toml"]
    )
    # kernel and initrd were already installed: only the new config was read from the source
    config = make_layout.file_content("configuration-qemu-nvidia-gpu-snp.toml")
    assert result.bytes_transferred == len(config)


def test_unknown_tag_lists_the_tags(tmp_path):
    with pytest.raises(ArtifactError) as error:
        install_artifact(f"oci-layout://{LAYOUT}:kata-qemu-typo", tmp_path / "rc")
    assert "kata-qemu-typo" in str(error.value) and GPU_TAG in str(error.value)
    assert not (tmp_path / "rc").exists()


def test_not_a_layout_names_the_dir(tmp_path):
    with pytest.raises(ArtifactError) as error:
        install_artifact(f"oci-layout://{tmp_path}/nowhere:{GPU_TAG}", tmp_path / "rc")
    assert f"{tmp_path}/nowhere" in str(error.value)


def _tampered_copy(tmp_path: Path, name: str) -> Path:
    layout = tmp_path / "layout"
    shutil.copytree(LAYOUT, layout)
    content = make_layout.file_content(name)
    for blob in (layout / "blobs" / "sha256").iterdir():
        if blob.read_bytes() == content:
            blob.write_bytes(content[:-1] + b"!")  # same size, other bytes
    return layout


def test_corrupt_layout_blob_fails_and_keeps_the_install(tmp_path):
    dest = tmp_path / "rc"
    install_artifact(f"oci-layout://{LAYOUT}:{SNP_TAG}", dest)
    before = snapshot(dest)
    layout = _tampered_copy(tmp_path, "configuration-qemu-nvidia-gpu.toml")
    with pytest.raises(ArtifactError) as error:
        install_artifact(f"oci-layout://{layout}:{GPU_TAG}", dest)
    message = str(error.value)
    assert "configuration-qemu-nvidia-gpu.toml" in message and "digest" in message
    assert snapshot(dest) == before
    assert leftovers(dest) == []


def test_layer_over_the_cap_is_refused_before_reading(tmp_path):
    with pytest.raises(ArtifactError) as error:
        install_artifact(f"oci-layout://{LAYOUT}:{GPU_TAG}", tmp_path / "rc", max_layer_bytes=100)
    # The cap is katamgr's own, fixed: the message never sends the operator to a setting that is not there.
    assert "100-byte cap on one artifact file" in str(error.value) and "not a setting" in str(error.value)
    assert "max_layer_bytes" not in str(error.value)
    assert not (tmp_path / "rc").exists()


def test_tampered_installed_file_is_repaired(tmp_path):
    dest = tmp_path / "rc"
    install_artifact(f"oci-layout://{LAYOUT}:{GPU_TAG}", dest)
    (dest / "vmlinux-nvidia-gpu").write_bytes(b"not the kernel")
    result = install_artifact(f"oci-layout://{LAYOUT}:{GPU_TAG}", dest)
    assert result.changed
    assert (dest / "vmlinux-nvidia-gpu").read_bytes() == make_layout.fake_kernel()
    assert result.bytes_transferred == len(make_layout.fake_kernel())


def test_crash_between_renames_is_recovered(tmp_path):
    dest = tmp_path / "rc"
    install_artifact(f"oci-layout://{LAYOUT}:{GPU_TAG}", dest)
    before = snapshot(dest)
    # the state a crash leaves after "rename dest -> .old" and before "rename staging -> dest"
    dest.rename(tmp_path / ".rc.old-123-456")
    (tmp_path / ".rc.staging-abc").mkdir()
    result = install_artifact(f"oci-layout://{LAYOUT}:{GPU_TAG}", dest)
    assert (result.changed, result.bytes_transferred) == (False, 0)
    assert snapshot(dest) == before
    assert leftovers(dest) == []


def test_swap_without_rename_exchange(tmp_path, monkeypatch):
    # filesystems without renameat2(RENAME_EXCHANGE) take the two-rename path
    monkeypatch.setattr(swap_module, "_exchange", lambda a, b: False)
    dest = tmp_path / "rc"
    install_artifact(f"oci-layout://{LAYOUT}:{GPU_TAG}", dest)
    result = install_artifact(f"oci-layout://{LAYOUT}:{SNP_TAG}", dest)
    assert result.changed
    assert (dest / "configuration-qemu-nvidia-gpu-snp.toml").exists()
    assert not (dest / "configuration-qemu-nvidia-gpu.toml").exists()
    assert leftovers(dest) == []


def test_traversal_title_in_a_layout_writes_nothing_outside(tmp_path):
    layout = tmp_path / "layout"
    shutil.copytree(LAYOUT, layout)
    blobs = layout / "blobs" / "sha256"
    index = json.loads((layout / "index.json").read_text())
    entry = index["manifests"][0]
    manifest = json.loads((blobs / entry["digest"].split(":")[1]).read_bytes())
    manifest["layers"][0]["annotations"]["org.opencontainers.image.title"] = "../../etc/passwd"
    data = json.dumps(manifest).encode()
    digest = make_layout._put(blobs, data)
    entry.update(digest)
    (layout / "index.json").write_text(json.dumps(index))
    dest = tmp_path / "install" / "rc"
    with pytest.raises(ArtifactError) as error:
        install_artifact(f"oci-layout://{layout}:{GPU_TAG}", dest)
    assert "'../../etc/passwd'" in str(error.value)
    assert not (tmp_path / "etc").exists() and not dest.exists()
