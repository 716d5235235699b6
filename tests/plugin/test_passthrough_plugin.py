"""VFIO passthrough resources served to the kubelet simulator.

Real gRPC over real unix sockets, on simulated hosts made from the example
profiles; binding goes through katamgr's own apply and the emulated kernel.
"""


from __future__ import annotations

import logging
import os

import grpc
import pytest
from support.hostkit import GPU_A10, dev
from support.passthroughkit import (
    A10,
    A10_IDS,
    FAST,
    H100,
    H100_IDS,
    NAMING,
    NVSWITCH,
    OPTED,
    PCI_IDS,
    bind,
    health,
    spec_nodes,
    write_spec,
)

from gpunode.host import vfio
from gpunode.policy.naming import Naming
from katamgr.pipeline.devices import apply_host
from katamgr.pipeline.plan import build_plan
from nodesim.kernel import handle_write
from nodesim.profile import parse_profile
from sandbox_plugin.discovery import PassthroughDiscovery
from sandbox_plugin.manager import Mode, PluginManager
from sandbox_plugin.resources import HEALTHY, UNHEALTHY
from sandbox_plugin.units import env_name


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
