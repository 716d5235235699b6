"""The nvidia.com/pgpu and nvidia.com/nvswitch specs katamgr writes for Kata pods."""

from __future__ import annotations

import json

import pytest
import yaml
from support.cdischema import official_validator
from support.hostkit import GPU_A10, dev, driver_of, make_host
from support.paths import HOST_PROFILES

import cdi
from gpunode.host.pci import is_vfio_driver
from gpunode.host.pciids import PciIds
from gpunode.policy.naming import Naming
from gpunode.policy.selection import Selection
from katamgr.pipeline.reconcile import Steps, full_plan, reconcile, revert_all
from nodesim import kernel
from nodesim.materialise import materialise
from nodesim.profile import load_profile

NAMING = Naming(PciIds.find())
PGPU = "/var/run/cdi/nvidia.com-pgpu.yaml"
NVSWITCH = "/var/run/cdi/nvidia.com-nvswitch.yaml"
A10_SPEC = "/var/run/cdi/nvidia.com-GA102GL_A10.yaml"
SCHEMA = official_validator()


def apply(host, naming=NAMING):
    report = reconcile(host, naming, Steps(), None)
    assert report.ok, report.failures
    return report


@pytest.mark.parametrize("profile_path", HOST_PROFILES, ids=lambda p: p.stem)
def test_specs_on_every_profile(tmp_path, profile_path):
    host = materialise(load_profile(profile_path), tmp_path / "host")
    apply(host)
    bound = sorted(d.bdf for d in load_profile(profile_path).devices
                   if d.vendor == 0x10DE and d.class_code >> 8 in (0x0300, 0x0302)
                   and is_vfio_driver(driver_of(host, d.bdf)))
    path = host.path(PGPU)
    if not bound:
        assert not path.exists()
        return
    document = yaml.safe_load(path.read_text())
    assert list(SCHEMA.iter_errors(document)) == []
    spec = cdi.read_spec(path)  # our validator too
    assert spec.cdi_version == "0.5.0" and spec.kind == "nvidia.com/pgpu"
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    # Index names follow PCI bus order: pgpu=i is the i-th bound GPU by address.
    for index, bdf in enumerate(bound):
        group = host.path(f"/sys/bus/pci/devices/{bdf}/iommu_group").resolve().name
        (node,) = spec.device(str(index)).container_edits.device_nodes
        assert node.path == f"/dev/vfio/{group}"
    # Every node a spec names exists on the (simulated) host.
    nodes = [n.path for n in spec.container_edits.device_nodes]
    nodes += [n.path for d in spec.devices for n in d.container_edits.device_nodes]
    for node in nodes:
        assert host.path(node).exists(), node
    # Nothing in the spec carries the host root we reached the host through.
    assert str(host.root) not in path.read_text()
    # Every spec written (the user-facing ones and one per advertised resource) is valid for
    # the official schema and declares the lowest cdiVersion that has what it uses.
    written = sorted(host.path("/var/run/cdi").iterdir())
    assert len(written) >= 2
    for file in written:
        assert list(SCHEMA.iter_errors(yaml.safe_load(file.read_text()))) == [], file.name
        each = cdi.read_spec(file)
        assert each.cdi_version == cdi.minimum_version(each), file.name
    stamp = path.stat().st_mtime_ns
    apply(host)
    assert path.stat().st_mtime_ns == stamp


def test_group_names_and_nvswitch_spec_on_dgx(tmp_path):
    host = materialise(load_profile([p for p in HOST_PROFILES if p.stem == "dgx-h100"][0]), tmp_path / "host")
    # NVSwitches opted in (the default keeps them on the host: Kata before 4.1 fails them).
    report = apply(host, Naming(PciIds.find(), selection=Selection(nvswitches=True)))
    pgpu = cdi.read_spec(host.path(PGPU))
    names = [d.name for d in pgpu.devices]
    assert names[:2] == ["0", "1"] and "8" in names
    # Group 6 is also index 6 (another GPU): the index wins and the plan says so.
    assert names.count("6") == 1
    assert any("not also named '6'" in w for w in report.warnings)
    nvswitch = cdi.read_spec(host.path(NVSWITCH))
    assert nvswitch.kind == "nvidia.com/nvswitch" and len({d.name for d in nvswitch.devices}) == 8


def test_iommufd_host_names_the_cdev(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4)], iommufd=True)
    apply(host)
    spec = cdi.read_spec(host.path(PGPU))
    assert [d.name for d in spec.devices] == ["0", "4", "vfio0"]
    assert [n.path for n in spec.container_edits.device_nodes] == ["/dev/iommu"]
    assert [n.path for n in spec.device("vfio0").container_edits.device_nodes] == ["/dev/vfio/devices/vfio0"]


def test_plan_shows_the_spec_it_would_write(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4), dev("0000:02:00.0", GPU_A10, "nvidia", 5)])
    plan = full_plan(host, NAMING, Steps(), None).to_json()
    entries = {e["path"]: e for e in plan["cdi"]["specs"]}
    assert set(entries) == {PGPU, A10_SPEC}
    entry = entries[PGPU]
    assert entry["action"] == "write"
    assert [d["name"] for d in entry["spec"]["devices"]] == ["0", "4", "1", "5"]
    # The names Kata's cold-plug resolves: the plugin's device IDs under the resource name.
    assert [d["name"] for d in entries[A10_SPEC]["spec"]["devices"]] == ["0000:01:00.0", "0000:02:00.0"]
    assert [c["name"] for c in plan["cdi"]["cold_plug"]] == [
        "nvidia.com/GA102GL_A10=0000:01:00.0", "nvidia.com/GA102GL_A10=0000:02:00.0"]
    assert not host.path(PGPU).exists()  # plan writes nothing
    json.dumps(plan)


def test_stale_spec_is_replaced_then_removed_and_revert_cleans_up(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4), dev("0000:02:00.0", GPU_A10, "nvidia", 5)])
    apply(host)
    assert len(cdi.read_spec(host.path(PGPU)).devices) == 4
    # Someone moves a GPU back to nvidia by hand; with binding off (vfioManager
    # disabled) the next reconcile follows the host and drops it from the spec.
    kernel.handle_write(host, "/sys/bus/pci/drivers/vfio-pci/unbind", "0000:02:00.0")
    kernel.handle_write(host, "/sys/bus/pci/devices/0000:02:00.0/driver_override", "")
    kernel.handle_write(host, "/sys/bus/pci/drivers_probe", "0000:02:00.0")
    reconcile(host, NAMING, Steps(vfio=False), None)
    assert [d.name for d in cdi.read_spec(host.path(PGPU)).devices] == ["0", "4"]
    kernel.handle_write(host, "/sys/bus/pci/drivers/vfio-pci/unbind", "0000:01:00.0")
    report = reconcile(host, NAMING, Steps(vfio=False), None)
    assert any("removed stale /var/run/cdi/nvidia.com-pgpu.yaml" in c for c in report.changes)
    assert not host.path(PGPU).exists()
    apply(host)
    assert host.path(PGPU).exists()
    revert_all(host, Steps(), None)
    assert not host.path(PGPU).exists()
    assert list(host.path("/var/run/cdi").iterdir()) == []


def test_foreign_spec_in_the_dir_is_left_alone(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4)])
    other = host.path("/var/run/cdi/vendor.example-thing.yaml")
    other.parent.mkdir(parents=True)
    other.write_text("cdiVersion: 0.5.0\nkind: vendor.example/thing\ndevices: []\n")
    apply(host)
    revert_all(host, Steps(), None)
    assert other.exists()


def test_two_gpus_in_one_group_get_one_group_name(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 15), dev("0000:02:00.0", GPU_A10, "nvidia", 15)])
    apply(host)
    spec = cdi.read_spec(host.path(PGPU))
    assert [d.name for d in spec.devices] == ["0", "15", "1"]
    for name in ("0", "15", "1"):
        assert [n.path for n in spec.device(name).container_edits.device_nodes] == ["/dev/vfio/15"]
    assert list(SCHEMA.iter_errors(yaml.safe_load(host.path(PGPU).read_text()))) == []


def test_plan_says_which_device_mode_each_gpu_is_handed_in(tmp_path):
    """iommufd where the kernel has /dev/iommu and the GPU its vfio-dev cdev, the group elsewhere;
    the reason names the Kata releases that take each (virtcontainers/qemu.go)."""
    for iommufd, mode, nodes in ((True, "iommufd", ["/dev/iommu", "/dev/vfio/devices/vfio0"]),
                                 (False, "group", ["/dev/vfio/vfio", "/dev/vfio/4"])):
        host = make_host(tmp_path / mode, [dev("0000:01:00.0", GPU_A10, "nvidia", 4)], iommufd=iommufd)
        apply(host)
        plan = full_plan(host, NAMING, Steps(), None)
        (unit,) = plan.to_json()["cdi"]["cold_plug"]
        assert (unit["mode"], unit["nodes"]) == (mode, nodes)
        lines = next(s for s in plan.sections if s.key == "cdi").lines
        said = next(line for line in lines if line.startswith("device mode:"))
        assert ("1 unit(s) iommufd" in said) is iommufd and "3.29 and 4.1 only the cdev for a confidential" in said
