"""Spec files on a real filesystem: atomic writes, reads, removal, directory override."""

from __future__ import annotations

import json
import os
import stat

import pytest
import yaml

import cdi


def pgpu_spec(groups=(15, 27), version="0.5.0") -> cdi.Spec:
    return cdi.Spec(
        cdi_version=version, kind="nvidia.com/pgpu",
        container_edits=cdi.ContainerEdits(device_nodes=[cdi.DeviceNode(path="/dev/vfio/vfio")]),
        devices=[cdi.Device(name=str(i), container_edits=cdi.ContainerEdits(
            device_nodes=[cdi.DeviceNode(path=f"/dev/vfio/{g}")])) for i, g in enumerate(groups)])


def test_spec_file_name():
    assert cdi.spec_file_name("nvidia.com/pgpu") == "nvidia.com-pgpu.yaml"
    assert cdi.spec_file_name("nvidia.com/pgpu", "json") == "nvidia.com-pgpu.json"
    with pytest.raises(cdi.InvalidNameError):
        cdi.spec_file_name("nvidia.com")
    with pytest.raises(cdi.CDIError, match="toml"):
        cdi.spec_file_name("nvidia.com/pgpu", "toml")


@pytest.mark.parametrize("fmt", cdi.FORMATS)
def test_write_spec_creates_a_0644_file_readable_as_its_format(tmp_path, fmt):
    old_umask = os.umask(0o077)  # the mode must not depend on the caller's umask
    try:
        assert cdi.write_spec(pgpu_spec(), tmp_path / "var/run/cdi", fmt=fmt) is True
    finally:
        os.umask(old_umask)
    path = tmp_path / "var/run/cdi" / f"nvidia.com-pgpu.{fmt}"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    text = path.read_text()
    document = json.loads(text) if fmt == "json" else yaml.safe_load(text)
    assert document["kind"] == "nvidia.com/pgpu"
    assert document["devices"][0] == {"name": "0", "containerEdits": {
        "deviceNodes": [{"path": "/dev/vfio/15"}]}}
    assert cdi.read_spec(path) == pgpu_spec()
    assert os.listdir(path.parent) == [path.name]  # no temp file left behind


def test_unchanged_content_leaves_the_file_untouched(tmp_path):
    assert cdi.write_spec(pgpu_spec(), tmp_path)
    path = tmp_path / "nvidia.com-pgpu.yaml"
    past = 1_000_000_000
    os.utime(path, ns=(past, past))
    before = path.stat()
    assert cdi.write_spec(pgpu_spec(), tmp_path) is False
    after = path.stat()
    assert (after.st_mtime_ns, after.st_ino) == (before.st_mtime_ns, before.st_ino) == \
        (past, before.st_ino)
    assert cdi.write_spec(pgpu_spec(groups=(15,)), tmp_path) is True
    assert path.stat().st_mtime_ns != past


def test_write_replaces_the_file_instead_of_rewriting_it(tmp_path):
    cdi.write_spec(pgpu_spec(), tmp_path)
    path = tmp_path / "nvidia.com-pgpu.yaml"
    with path.open() as reader:  # a runtime reading the old spec while we write
        cdi.write_spec(pgpu_spec(groups=(15,)), tmp_path)
        assert yaml.safe_load(reader.read()) == pgpu_spec().to_dict()
    assert cdi.read_spec(path) == pgpu_spec(groups=(15,))


def test_failed_write_keeps_the_old_file_and_no_temp(tmp_path, monkeypatch):
    cdi.write_spec(pgpu_spec(), tmp_path)
    original = (tmp_path / "nvidia.com-pgpu.yaml").read_bytes()

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space"):
        cdi.write_spec(pgpu_spec(groups=(1,)), tmp_path)
    monkeypatch.undo()
    assert (tmp_path / "nvidia.com-pgpu.yaml").read_bytes() == original
    assert os.listdir(tmp_path) == ["nvidia.com-pgpu.yaml"]


def test_invalid_spec_is_never_written(tmp_path):
    cdi.write_spec(pgpu_spec(), tmp_path)
    original = (tmp_path / "nvidia.com-pgpu.yaml").read_bytes()
    with pytest.raises(cdi.InvalidSpecError, match=r"devices\[0\]\.name"):
        cdi.write_spec(pgpu_spec(version="0.4.0"), tmp_path)  # digit names need 0.5.0
    assert (tmp_path / "nvidia.com-pgpu.yaml").read_bytes() == original


def test_write_spec_with_a_name(tmp_path):
    assert cdi.write_spec(pgpu_spec(), tmp_path, name="vfio-gpus")
    assert cdi.write_spec(pgpu_spec(), tmp_path, fmt="json", name="other.json")
    assert sorted(os.listdir(tmp_path)) == ["other.json", "vfio-gpus.yaml"]
    for bad in ("../escape", "a/b", ".hidden", ""):
        with pytest.raises(cdi.CDIError, match="plain file name"):
            cdi.write_spec(pgpu_spec(), tmp_path, name=bad)
    with pytest.raises(cdi.CDIError, match="does not match format"):
        cdi.write_spec(pgpu_spec(), tmp_path, fmt="json", name="x.yaml")
    assert cdi.remove_spec(tmp_path, "nvidia.com/pgpu", name="vfio-gpus") is True
    assert os.listdir(tmp_path) == ["other.json"]


def test_remove_spec(tmp_path):
    assert cdi.remove_spec(tmp_path, "nvidia.com/pgpu") is False
    cdi.write_spec(pgpu_spec(), tmp_path)
    cdi.write_spec(pgpu_spec(), tmp_path, fmt="json")
    (tmp_path / "keep.yaml").write_text("x")
    assert cdi.remove_spec(tmp_path, "nvidia.com/pgpu") is True
    assert os.listdir(tmp_path) == ["keep.yaml"]
    assert cdi.remove_spec(tmp_path, "nvidia.com/pgpu") is False


def test_read_spec_errors_name_the_file(tmp_path):
    missing = tmp_path / "missing.yaml"
    with pytest.raises(cdi.SpecFileError, match="missing.yaml: cannot be read") as caught:
        cdi.read_spec(missing)
    assert caught.value.path == str(missing)
    broken = tmp_path / "broken.json"
    broken.write_text('{"cdiVersion": ')
    with pytest.raises(cdi.SpecFileError, match="broken.json: not valid JSON"):
        cdi.read_spec(broken)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(cdi.SpecFileError, match="empty.yaml: the document is empty"):
        cdi.read_spec(empty)
    # JSON is parsed as JSON, so YAML-only syntax in a .json file is an error.
    yamlish = tmp_path / "yamlish.json"
    yamlish.write_text(cdi.dump_spec(pgpu_spec(), "yaml"))
    with pytest.raises(cdi.SpecFileError, match="yamlish.json: not valid JSON"):
        cdi.read_spec(yamlish)


# ---------------------------------------------------------------- load_specs

def _write(directory, name, kind, devices, version="0.5.0"):
    directory.mkdir(parents=True, exist_ok=True)
    spec = cdi.Spec(cdi_version=version, kind=kind, devices=[
        cdi.Device(name=n, container_edits=cdi.ContainerEdits(env=[f"FROM={tag}"]))
        for n, tag in devices.items()])
    cdi.write_spec(spec, directory, fmt="json" if name.endswith(".json") else "yaml",
                   name=name)


def _origin(registry, device):
    return registry.resolve(device).device.container_edits.env[0]


def test_later_directory_overrides_earlier(tmp_path):
    etc, run = tmp_path / "etc/cdi", tmp_path / "var/run/cdi"
    _write(etc, "nvidia.com-pgpu.yaml", "nvidia.com/pgpu", {"0": "etc", "1": "etc"})
    _write(run, "nvidia.com-pgpu.json", "nvidia.com/pgpu", {"0": "run"})
    registry = cdi.load_specs([etc, run])
    assert registry.device_names() == ["nvidia.com/pgpu=0", "nvidia.com/pgpu=1"]
    assert _origin(registry, "nvidia.com/pgpu=0") == "FROM=run"
    assert _origin(registry, "nvidia.com/pgpu=1") == "FROM=etc"
    assert registry.resolve("nvidia.com/pgpu=0").source.path == run / "nvidia.com-pgpu.json"
    assert registry.errors == {}
    # Reversing the order reverses the priority.
    assert _origin(cdi.load_specs([run, etc]), "nvidia.com/pgpu=0") == "FROM=etc"


def test_conflict_within_one_directory_is_reported_per_file(tmp_path):
    etc, run = tmp_path / "etc", tmp_path / "run"
    _write(run, "a.yaml", "nvidia.com/pgpu", {"0": "a", "1": "a"})
    _write(run, "b.yaml", "nvidia.com/pgpu", {"0": "b", "2": "b"})
    (run / "broken.yaml").write_text("cdiVersion: 0.5.0\nkind: nvidia.com\ndevices: []\n")
    (run / "notes.txt").write_text("not a spec")
    (run / "subdir.yaml").mkdir()
    registry = cdi.load_specs([etc, run])  # etc does not exist: fine
    assert registry.device_names() == ["nvidia.com/pgpu=1", "nvidia.com/pgpu=2"]
    assert set(registry.errors) == {str(run / "a.yaml"), str(run / "b.yaml"),
                                    str(run / "broken.yaml")}
    assert "nvidia.com/pgpu=0" in registry.errors[str(run / "a.yaml")][0]
    assert "kind" in registry.errors[str(run / "broken.yaml")][0]
    with pytest.raises(cdi.UnresolvedDeviceError, match="more than one spec"):
        registry.resolve("nvidia.com/pgpu=0")
    # A higher-priority directory settles a lower one's conflict.
    _write(tmp_path / "top", "x.yaml", "nvidia.com/pgpu", {"0": "top"})
    assert _origin(cdi.load_specs([etc, run, tmp_path / "top"]), "nvidia.com/pgpu=0") == \
        "FROM=top"


def test_resolve_unknown_and_malformed_names(tmp_path):
    _write(tmp_path, "v.yaml", "vendor.com/device", {"dev": "x"})
    registry = cdi.load_specs([tmp_path])
    assert "vendor.com/device=dev" in registry
    assert registry.get("vendor.com/device=nope") is None
    with pytest.raises(cdi.UnresolvedDeviceError, match=str(tmp_path)):
        registry.resolve("vendor.com/device=nope")
    with pytest.raises(cdi.InvalidNameError):
        registry.resolve("not-qualified")
    assert registry.vendors() == ["vendor.com"] and registry.classes() == ["device"]
    assert registry.resolve("vendor.com/device=dev").spec.kind == "vendor.com/device"


def test_default_dirs_are_the_cdi_ones():
    assert cdi.DEFAULT_SPEC_DIRS == ("/etc/cdi", "/var/run/cdi")
