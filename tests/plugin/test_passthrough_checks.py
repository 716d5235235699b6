"""The passthrough plugin's checks between scans: Allocate re-reads sysfs and the device
nodes (a device moved, unbound or replaced meanwhile is refused), a unit whose device left
vfio-pci behind our back stays listed Unhealthy, the plugin judges a group's viability by
the plan's rule, and Allocate's answer is reused only while nothing changed."""

from __future__ import annotations

import os
import threading
import time

import pytest
from support.hostkit import GPU_A10, dev
from support.passthroughkit import A10, NAMING, bind, health_of, write_spec

from gpunode.host import pci, vfio
from katamgr.pipeline.plan import build_plan
from nodesim.kernel import handle_write
from sandbox_plugin.discovery import PassthroughDiscovery
from sandbox_plugin.resources import HEALTHY, UNHEALTHY, AllocationError, UnknownDeviceError
from sandbox_plugin.units import env_name


def test_allocate_rechecks_sysfs_even_before_the_watcher_noticed(sim_host):
    host, _kubelet = sim_host("a10-server")
    bind(host)
    discovery = PassthroughDiscovery(host, NAMING)  # no watcher: the snapshot goes stale
    discovery.refresh()
    resource = discovery.resources[A10]
    handle_write(host, "/sys/bus/pci/drivers/vfio-pci/unbind", "0000:31:00.0")
    with pytest.raises(AllocationError) as error:
        resource.allocate(["0000:31:00.0"])
    assert "0000:31:00.0" in error.value.message and "no longer on vfio-pci" in error.value.message
    with pytest.raises(UnknownDeviceError, match="0000:00:00.0"):
        resource.allocate(["0000:00:00.0"])
    assert resource.allocate(["0000:17:00.0"]).envs == {env_name(A10): "0000:17:00.0"}


def test_allocate_refuses_a_device_whose_node_or_group_changed_meanwhile(sim_host):
    host, _kubelet = sim_host("a10-server")
    bind(host)
    discovery = PassthroughDiscovery(host, NAMING)  # no watcher: the snapshot goes stale
    discovery.refresh()
    resource = discovery.resources[A10]
    unit = next(u for u in resource.units() if u.id == "0000:17:00.0")
    node = host.path(f"/dev/vfio/{unit.group}")
    assert resource.allocate([unit.id]).devices  # warm: the check must not be cached
    node.unlink()
    with pytest.raises(AllocationError, match=f"/dev/vfio/{unit.group} is missing"):
        resource.allocate([unit.id])
    node.touch()
    assert resource.allocate([unit.id]).envs == {env_name(A10): unit.id}

    link = host.path(f"/sys/bus/pci/devices/{unit.id}/iommu_group")
    target = os.readlink(link)
    moved = target.rsplit("/", 1)[0] + "/999"
    os.unlink(link)
    os.symlink(moved, link)
    link.resolve().mkdir()
    with pytest.raises(AllocationError, match=f"moved from IOMMU group {unit.group} to 999"):
        resource.allocate([unit.id])


def test_binding_read_agrees_with_the_full_read(sim_host):
    host, _kubelet = sim_host("dgx-h100")
    bind(host, skip_groups={16})  # some devices on vfio-pci, one left on its driver
    for device in pci.scan(host):
        light = pci.read_binding(host, device.bdf)
        assert (light.vendor, light.device, light.driver, light.iommu_group) == (
            device.vendor, device.device, device.driver, device.iommu_group), device.bdf
    assert pci.read_binding(host, "0000:99:00.0").vendor is None


def test_a_device_unbound_behind_our_back_stays_listed_unhealthy_until_back_or_unplugged(sim_host):
    """The kubelet's contract (device plugin v1beta1 ListAndWatch): a failed device is
    reported Unhealthy so the kubelet stops placing pods on it while a pod that has it
    keeps it; a device that vanishes from the list is taken as removed."""
    host, _kubelet = sim_host("a10-server")
    bind(host)
    discovery = PassthroughDiscovery(host, NAMING)
    discovery.refresh()
    resource = discovery.resources[A10]
    handle_write(host, "/sys/bus/pci/drivers/vfio-pci/unbind", "0000:31:00.0")
    discovery.refresh()
    states = {d.id: d.health for d in resource.devices()}
    assert states["0000:31:00.0"] == UNHEALTHY and len(states) == 4
    unit = next(u for u in resource.units() if u.id == "0000:31:00.0")
    assert unit.reason == "0000:31:00.0 left vfio-pci (driver: none)"
    with pytest.raises(AllocationError, match="no longer on vfio-pci"):
        resource.allocate(["0000:31:00.0"])
    assert not discovery.refresh() and not resource.update(
        [u for u in resource.units() if u.id != "0000:31:00.0"])  # a rescan changes nothing more

    # Back on vfio-pci: Healthy again.
    handle_write(host, "/sys/bus/pci/devices/0000:31:00.0/driver_override", "vfio-pci")
    handle_write(host, "/sys/bus/pci/drivers_probe", "0000:31:00.0")
    discovery.refresh()
    assert {d.id: d.health for d in resource.devices()}["0000:31:00.0"] == HEALTHY

    # Given back on purpose (katamgr revert restores the override and the driver): dropped.
    assert not vfio.unbind_all(host).failures
    discovery.refresh()
    assert resource.devices() == []
    bind(host)
    discovery.refresh()

    # Unbound behind our back again, then unplugged: gone from the list.
    handle_write(host, "/sys/bus/pci/drivers/vfio-pci/unbind", "0000:31:00.0")
    discovery.refresh()
    assert {d.id: d.health for d in resource.devices()}["0000:31:00.0"] == UNHEALTHY
    discovery.refresh()
    link = host.path("/sys/bus/pci/devices/0000:31:00.0")
    target = link.resolve()
    link.unlink()
    import shutil

    shutil.rmtree(target)
    discovery.refresh()
    assert "0000:31:00.0" not in {d.id for d in resource.devices()}


def test_plugin_health_follows_the_same_viability_rule_as_the_plan(tmp_path):
    """A member on pci-stub leaves DMA to the group's owner (the kernel's rule that
    gpunode.host.vfio plans by): the plugin must not call such a group unhealthy,
    nor one whose member is on a driver that owns DMA healthy."""
    from support.hostkit import NIC_I210, make_host

    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "vfio-pci", 4),
                                dev("0000:02:00.0", NIC_I210, "pci-stub", 4),
                                dev("0000:03:00.0", GPU_A10, "vfio-pci", 5),
                                dev("0000:04:00.0", NIC_I210, "igb", 5)])
    assert build_plan(host, NAMING).resources == {A10: 1}
    discovery = PassthroughDiscovery(host, NAMING)
    discovery.refresh()
    states = {d.id: d.health for d in discovery.resources[A10].devices()}
    assert states == {"0000:01:00.0": HEALTHY, "0000:03:00.0": UNHEALTHY}


def test_allocate_hands_out_the_same_answer_until_devices_or_specs_change(sim_host):
    """The server reuses its encoded answer while the resource returns the very same
    allocation; every call still re-checks sysfs and the spec files."""
    host, _kubelet = sim_host("a10-server")
    bind(host)
    discovery = PassthroughDiscovery(host, NAMING)
    discovery.refresh()
    resource = discovery.resources[A10]
    first = resource.allocate(["0000:17:00.0"])
    assert resource.allocate(["0000:17:00.0"]) is first
    assert first.cdi_devices == []
    write_spec(host)  # seen at the next call, no watcher needed
    named = resource.allocate(["0000:17:00.0"])
    assert named is not first and named.cdi_devices == ["nvidia.com/pgpu=0"]
    assert resource.allocate(["0000:17:00.0"]) is named
    handle_write(host, "/sys/bus/pci/drivers/vfio-pci/unbind", "0000:31:00.0")
    discovery.refresh()
    assert resource.allocate(["0000:17:00.0"]) is not named  # the units changed
    with pytest.raises(AllocationError, match="no longer on vfio-pci"):
        resource.allocate(["0000:31:00.0"])
    discovery.close()


def test_without_inotify_the_specs_are_read_on_every_allocate(sim_host, monkeypatch):
    from sandbox_plugin import cdinames

    def no_inotify(*args, **kwargs):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(cdinames, "INotify", no_inotify)
    host, _kubelet = sim_host("a10-server")
    bind(host)
    discovery = PassthroughDiscovery(host, NAMING)
    discovery.refresh()
    resource = discovery.resources[A10]
    assert resource.allocate(["0000:17:00.0"]).cdi_devices == []
    write_spec(host)
    assert resource.allocate(["0000:17:00.0"]).cdi_devices == ["nvidia.com/pgpu=0"]


def test_a_removed_group_node_is_unhealthy_before_the_rescan(sim_host):
    """The watcher reports a VFIO node gone from its first event; the rescan after the
    burst settles finds the same and changes nothing more."""
    from sandbox_plugin.watch import DeviceWatcher

    host, _kubelet = sim_host("a10-server")
    bind(host)
    discovery = PassthroughDiscovery(host, NAMING)
    discovery.refresh()
    resource = discovery.resources[A10]
    seen: list[str] = []
    gone_first = threading.Event()

    def on_node_gone(node: str) -> None:
        seen.append(node)
        discovery.node_gone(node)
        gone_first.set()

    def on_change() -> None:
        seen.append("rescan")
        discovery.refresh()

    watcher = DeviceWatcher(host, on_change, on_node_gone=on_node_gone, rescan_interval=60)
    watcher.start()
    try:
        generation = resource.changes.generation
        host.path("/dev/vfio/21").unlink()
        assert gone_first.wait(5)
        assert health_of(resource)["0000:31:00.0"] == UNHEALTHY
        deadline = time.monotonic() + 5
        while "rescan" not in seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == ["/dev/vfio/21", "rescan"]
        assert resource.changes.generation == generation + 1  # the rescan found nothing new
        assert next(u for u in resource.units() if u.id == "0000:31:00.0").reason == "/dev/vfio/21 is missing"
    finally:
        watcher.stop()
