"""VFIO passthrough resources served to the kubelet simulator.

Real gRPC over real unix sockets, on simulated hosts made from the example
profiles; binding goes through katamgr's own apply and the emulated kernel.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import grpc
import pytest
from support.hostkit import GPU_A10, dev

import cdi
from katamgr.host import pci, vfio
from katamgr.host.inventory import discover
from katamgr.host.naming import Naming, resource_name
from katamgr.host.pciids import PciIds
from katamgr.host.selection import Selection
from katamgr.node.backoff import Backoff
from katamgr.pipeline.cdi_specs import write_specs
from katamgr.pipeline.devices import apply_host
from katamgr.pipeline.plan import build_plan
from nodesim.kernel import handle_write
from nodesim.profile import parse_profile
from sandbox_plugin.manager import Mode, PluginManager
from sandbox_plugin.passthrough import PassthroughDiscovery, env_name
from sandbox_plugin.resources import HEALTHY, UNHEALTHY, AllocationError, UnknownDeviceError

PCI_IDS = PciIds.find()
# The NVSwitches opted in (--nvswitches true), so that the dgx-h100 node serves two resources;
# by default they stay on the host (tests/kata shows why: Kata before 4.1 fails them).
OPTED = Selection(nvswitches=True)
NAMING = Naming(PCI_IDS, selection=OPTED)
A10 = "nvidia.com/GA102GL_A10"
H100 = resource_name(PCI_IDS, 0x10DE, 0x2330)
NVSWITCH = resource_name(PCI_IDS, 0x10DE, 0x22A3)
FAST = Backoff(initial=0.05, factor=2.0, cap=0.4)
A10_IDS = ["0000:17:00.0", "0000:31:00.0", "0000:ca:00.0", "0000:e3:00.0"]
H100_IDS = ["0000:03:00.0", "0000:04:00.0", "0000:13:00.0", "0000:14:00.0",
            "0000:83:00.0", "0000:84:00.0", "0000:93:00.0", "0000:94:00.0"]


@pytest.fixture
def serve(sim_host):
    """serve(host, naming=NAMING): a running PluginManager, stopped before the host goes."""
    managers: list[PluginManager] = []

    def start(host, naming: Naming = NAMING) -> PluginManager:
        manager = PluginManager(host, Mode.VM_PASSTHROUGH, naming=naming, backoff=FAST)
        managers.append(manager)
        manager.start()
        return manager

    yield start
    for manager in managers:
        manager.stop()


def bind(host, skip_groups=()) -> None:
    """katamgr's binding, leaving the IOMMU groups in ``skip_groups`` on their driver."""
    decisions = [d for d in build_plan(host, NAMING).decisions if d.group not in skip_groups]
    report = vfio.bind(host, decisions)
    assert not report.failures


def write_spec(host) -> None:
    """What katamgr's reconcile does after binding when cdi is enabled."""
    assert write_specs(host, discover(host, OPTED), NAMING).ok


def spec_nodes(host, name: str) -> list[str]:
    """The device nodes the host's specs inject for ``name``, as containerd would read them."""
    registry = cdi.load_specs([host.path(d) for d in cdi.DEFAULT_SPEC_DIRS])
    return [n.path for n in registry.resolve(name).device.container_edits.device_nodes]


def health(state, name):
    return {d.id: d.health for d in state.devices.get(name, [])}


def test_dgx_h100_registers_one_resource_per_model(sim_host, serve):
    host, kubelet = sim_host("dgx-h100")
    bind(host)
    serve(host)
    state = kubelet.wait_for(
        lambda s: len(s.devices.get(H100, [])) == 8 and len(s.devices.get(NVSWITCH, [])) == 4
    )
    assert {r.resource_name for r in state.registrations} == {H100, NVSWITCH}
    assert health(state, H100) == dict.fromkeys(H100_IDS, HEALTHY)
    assert [d.numa_node for d in state.devices[H100]] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert sorted(health(state, NVSWITCH)) == ["0000:05:00.0", "0000:15:00.0", "0000:85:00.0",
                                               "0000:95:00.0"]
    assert state.options[H100].get_preferred_allocation_available


def test_dgx_h100_keeps_its_nvswitches_off_by_default(sim_host, serve):
    host, kubelet = sim_host("dgx-h100")
    bind(host)
    serve(host, Naming(PCI_IDS))
    state = kubelet.wait_for(lambda s: len(s.devices.get(H100, [])) == 8)
    assert {r.resource_name for r in state.registrations} == {H100}


def test_a10_server_registers_ga102gl_a10(sim_host, serve):
    host, kubelet = sim_host("a10-server")
    bind(host)
    serve(host)
    state = kubelet.wait_for(lambda s: len(s.devices.get(A10, [])) == 4)
    assert [r.resource_name for r in state.registrations] == [A10]
    assert [(d.id, d.health, d.numa_node) for d in state.devices[A10]] == [
        ("0000:17:00.0", HEALTHY, 0), ("0000:31:00.0", HEALTHY, 0),
        ("0000:ca:00.0", HEALTHY, 1), ("0000:e3:00.0", HEALTHY, 1),
    ]


def test_alias_mode_uses_one_name_per_class(sim_host, serve):
    host, kubelet = sim_host("dgx-h100")
    bind(host)
    serve(host, Naming(PCI_IDS, "pgpu", "nvswitch", selection=OPTED))
    state = kubelet.wait_for(
        lambda s: len(s.devices.get("nvidia.com/pgpu", [])) == 8
        and len(s.devices.get("nvidia.com/nvswitch", [])) == 4
    )
    assert {r.resource_name for r in state.registrations} == {"nvidia.com/pgpu", "nvidia.com/nvswitch"}


def test_allocate_one_and_several_gpus(sim_host, serve):
    host, kubelet = sim_host("a10-server")
    bind(host)
    write_spec(host)
    serve(host)
    kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4)

    one = kubelet.allocate(A10, ["0000:17:00.0"])
    assert [(d.host_path, d.container_path, d.permissions) for d in one.devices] == [
        ("/dev/vfio/vfio", "/dev/vfio/vfio", "rw"), ("/dev/vfio/20", "/dev/vfio/20", "rw"),
    ]
    assert dict(one.envs) == {"PCI_RESOURCE_NVIDIA_COM_GA102GL_A10": "0000:17:00.0"}
    assert [c.name for c in one.cdi_devices] == ["nvidia.com/pgpu=0"]

    several = kubelet.allocate(A10, ["0000:ca:00.0", "0000:e3:00.0"])
    assert [d.host_path for d in several.devices] == ["/dev/vfio/vfio", "/dev/vfio/41", "/dev/vfio/43"]
    assert dict(several.envs) == {"PCI_RESOURCE_NVIDIA_COM_GA102GL_A10": "0000:ca:00.0,0000:e3:00.0"}
    assert [c.name for c in several.cdi_devices] == ["nvidia.com/pgpu=2", "nvidia.com/pgpu=3"]
    # Host paths are the host's, never the root we read it through.
    assert not any(str(host.root) in d.host_path for d in several.devices)


def test_without_a_spec_allocate_gives_the_nodes_and_no_cdi_name(sim_host, serve, caplog):
    host, kubelet = sim_host("a10-server")
    bind(host)  # cdi.enabled=false: katamgr binds but writes no spec
    serve(host)
    kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4)
    caplog.set_level(logging.WARNING, logger="sandbox_plugin.cdinames")

    for _ in range(2):
        answer = kubelet.allocate(A10, ["0000:17:00.0"])
        assert [d.host_path for d in answer.devices] == ["/dev/vfio/vfio", "/dev/vfio/20"]
        assert list(answer.cdi_devices) == []  # nothing containerd could not resolve
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings  # once, not on every Allocate
    assert "0000:17:00.0" in warnings[0] and "/var/run/cdi/nvidia.com-pgpu.yaml" in warnings[0]

    write_spec(host)  # cdi enabled later: the names follow without a restart
    answer = kubelet.allocate(A10, ["0000:17:00.0", "0000:ca:00.0"])
    assert [c.name for c in answer.cdi_devices] == ["nvidia.com/pgpu=0", "nvidia.com/pgpu=2"]


def test_a_stale_spec_never_names_another_gpu(sim_host, caplog):
    host, _kubelet = sim_host("a10-server")
    bind(host, skip_groups={43})  # 0000:e3:00.0 stays on its driver for now
    write_spec(host)
    assert spec_nodes(host, "nvidia.com/pgpu=0") == ["/dev/vfio/20"]  # 0000:17:00.0
    discovery = PassthroughDiscovery(host, NAMING)
    handle_write(host, "/sys/bus/pci/drivers/vfio-pci/unbind", "0000:17:00.0")
    discovery.refresh()  # the plugin sees the change; the spec is not rewritten
    resource = discovery.resources[A10]
    moved = next(u for u in resource.units() if u.id == "0000:31:00.0")
    assert moved.members[0].qualified_name == "nvidia.com/pgpu=0"  # its index now; not the spec's

    for device_id, group in (("0000:31:00.0", 21), ("0000:ca:00.0", 41)):
        names = resource.allocate([device_id]).cdi_devices
        assert names, device_id  # the spec still names it, by its old index
        for name in names:
            assert spec_nodes(host, name) == [f"/dev/vfio/{group}"], (device_id, name)
    assert resource.allocate(["0000:31:00.0"]).cdi_devices == ["nvidia.com/pgpu=1"]

    # A GPU bound after the spec was written has no name in it at all.
    assert not vfio.bind(host, [d for d in build_plan(host, NAMING).decisions if d.group == 43]).failures
    discovery.refresh()
    caplog.set_level(logging.WARNING, logger="sandbox_plugin.cdinames")
    answer = resource.allocate(["0000:e3:00.0"])
    assert answer.cdi_devices == []
    assert [d.host_path for d in answer.devices] == ["/dev/vfio/vfio", "/dev/vfio/43"]
    message = caplog.records[-1].getMessage()
    assert "0000:e3:00.0" in message and "/var/run/cdi/nvidia.com-pgpu.yaml" in message

    write_spec(host)  # katamgr reconciles: the canonical names come back
    assert resource.allocate(["0000:31:00.0"]).cdi_devices == ["nvidia.com/pgpu=0"]
    assert resource.allocate(["0000:e3:00.0"]).cdi_devices == ["nvidia.com/pgpu=2"]
    assert spec_nodes(host, "nvidia.com/pgpu=0") == ["/dev/vfio/21"]


def test_allocate_refuses_unknown_and_unbound_devices(sim_host, serve):
    host, kubelet = sim_host("a10-server")
    bind(host)
    serve(host)
    kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4)

    with pytest.raises(grpc.RpcError) as unknown:
        kubelet.allocate(A10, ["0000:99:00.0"])
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "0000:99:00.0" in unknown.value.details()

    handle_write(host, "/sys/bus/pci/drivers/vfio-pci/unbind", "0000:31:00.0")
    with pytest.raises(grpc.RpcError) as gone:
        kubelet.allocate(A10, ["0000:17:00.0", "0000:31:00.0"])
    assert "0000:31:00.0" in gone.value.details()
    # ... and the kubelet learns that the device failed: still listed (a pod may hold it;
    # the kubelet counts it in capacity, not in allocatable), Unhealthy.
    state = kubelet.wait_for(lambda s: health(s, A10).get("0000:31:00.0") == "Unhealthy", timeout=2)
    assert sorted(health(state, A10)) == sorted(A10_IDS)
    assert [i for i, h in health(state, A10).items() if h == "Healthy"] != []


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


def test_missing_group_node_turns_unhealthy_and_heals(sim_host, serve):
    host, kubelet = sim_host("a10-server")
    bind(host)
    serve(host)
    kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4)

    node = host.path("/dev/vfio/21")
    node.unlink()
    state = kubelet.wait_for(lambda s: health(s, A10).get("0000:31:00.0") == UNHEALTHY, timeout=1)
    assert sorted(state.healthy(A10)) == [A10_IDS[0], *A10_IDS[2:]]
    with pytest.raises(grpc.RpcError) as error:
        kubelet.allocate(A10, ["0000:31:00.0"])
    assert "/dev/vfio/21" in error.value.details()

    node.touch()
    kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4, timeout=1)


def test_gpus_and_models_bound_later_are_advertised(sim_host, serve):
    host, kubelet = sim_host("dgx-h100")
    # Everything but one GPU (IOMMU group 38) and the NVSwitches goes to vfio-pci first.
    bind(host, skip_groups={38, 10, 20, 30, 40})
    manager = serve(host)
    state = kubelet.wait_for(lambda s: len(s.devices.get(H100, [])) == 7)
    assert "0000:94:00.0" not in health(state, H100)
    assert NVSWITCH not in state.devices

    report = apply_host(host, build_plan(host, NAMING))
    assert report.ok, report.failures
    state = kubelet.wait_for(
        lambda s: len(s.healthy(H100)) == 8 and len(s.healthy(NVSWITCH)) == 4, timeout=3
    )
    assert set(manager.servers) == {H100, NVSWITCH}


def test_hot_unplug_and_replug_change_the_list(sim_host, serve):
    host, kubelet = sim_host("a10-server")
    bind(host)
    serve(host)
    kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4)
    link = host.path("/sys/bus/pci/devices/0000:e3:00.0")
    target = os.readlink(link)
    link.unlink()  # what the kernel's PCI hot-remove leaves in /sys/bus/pci/devices
    kubelet.wait_for(lambda s: sorted(health(s, A10)) == A10_IDS[:3], timeout=2)
    os.symlink(target, link)
    kubelet.wait_for(lambda s: sorted(s.healthy(A10)) == A10_IDS, timeout=2)


def test_kubelet_restart_reregisters_every_resource(sim_host, serve):
    host, kubelet = sim_host("dgx-h100")
    bind(host)
    serve(host)
    kubelet.wait_for(lambda s: len(s.devices.get(H100, [])) == 8 and len(s.devices.get(NVSWITCH, [])) == 4)
    kubelet.restart()
    state = kubelet.wait_for(
        lambda s: len(s.registrations_for(H100)) == 2 and len(s.registrations_for(NVSWITCH)) == 2
        and len(s.devices.get(H100, [])) == 8 and len(s.devices.get(NVSWITCH, [])) == 4,
        timeout=10,
    )
    assert state.restarts == 1


def shared_group_profile(iommufd: bool = False):
    return parse_profile({
        "name": "shared-group",
        "iommu": True,
        "iommufd": iommufd,
        "vfio_pci": "loaded",
        "devices": [
            dev("0000:41:00.0", GPU_A10, "vfio-pci", 7),
            dev("0000:41:00.1", GPU_A10, "vfio-pci", 7),  # same group: one schedulable unit
            dev("0000:42:00.0", GPU_A10, "vfio-pci", 8, numa_node=1),
        ],
    })


def test_two_gpus_in_one_iommu_group_are_one_device(sim_host, serve):
    host, kubelet = sim_host(shared_group_profile())
    write_spec(host)
    serve(host)
    state = kubelet.wait_for(lambda s: len(s.devices.get(A10, [])) == 2)
    assert [(d.id, d.numa_node) for d in state.devices[A10]] == [("0000:41:00.0", 0), ("0000:42:00.0", 1)]

    both = kubelet.allocate(A10, ["0000:41:00.0"])
    assert [d.host_path for d in both.devices] == ["/dev/vfio/vfio", "/dev/vfio/7"]
    assert dict(both.envs) == {env_name(A10): "0000:41:00.0,0000:41:00.1"}
    assert [c.name for c in both.cdi_devices] == ["nvidia.com/pgpu=0", "nvidia.com/pgpu=1"]


def test_iommufd_host_gets_iommu_and_cdev_nodes(sim_host, serve):
    host, kubelet = sim_host(shared_group_profile(iommufd=True))
    serve(host)
    kubelet.wait_for(lambda s: len(s.healthy(A10)) == 2)
    answer = kubelet.allocate(A10, ["0000:42:00.0"])
    cdev = sorted(p.name for p in host.path("/sys/bus/pci/devices/0000:42:00.0/vfio-dev").iterdir())[0]
    assert [d.host_path for d in answer.devices] == ["/dev/iommu", f"/dev/vfio/devices/{cdev}"]
    assert list(answer.cdi_devices) == []
    write_spec(host)
    named = kubelet.allocate(A10, ["0000:42:00.0"])
    assert [c.name for c in named.cdi_devices] == ["nvidia.com/pgpu=2"]
    assert spec_nodes(host, "nvidia.com/pgpu=2") == [f"/dev/vfio/devices/{cdev}"]

    # The cdev is the iommufd-era health signal.
    host.path(f"/dev/vfio/devices/{cdev}").unlink()
    kubelet.wait_for(lambda s: health(s, A10).get("0000:42:00.0") == UNHEALTHY, timeout=1)


def test_env_name_follows_kubevirt():
    assert env_name("nvidia.com/GA102GL_A10") == "PCI_RESOURCE_NVIDIA_COM_GA102GL_A10"
    assert env_name("nvidia.com/pgpu") == "PCI_RESOURCE_NVIDIA_COM_PGPU"
    assert env_name("example-x.io/a-b") == "PCI_RESOURCE_EXAMPLE_X_IO_A_B"


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
    katamgr.host.vfio plans by): the plugin must not call such a group unhealthy,
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


def health_of(resource) -> dict[str, str]:
    return {d.id: d.health for d in resource.devices()}
