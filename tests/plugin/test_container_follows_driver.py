"""The container plugin offers every GPU the ``nvidia`` driver has, whichever path moved it
there, without a restart: the agent's give-back after a relabel (the free GPUs at once, the
held ones once their VMs let go), ``katamgr revert``, an operator's own bind; and stops
offering a GPU that leaves the driver.

NVML lists the GPUs it found at ``nvmlInit`` until ``nvmlShutdown`` (NVML API reference,
"Initialization and Cleanup"), and so does its stand-in on a simulated node
(``FakeNvml.for_simulated_host``: the GPUs on ``nvidia`` in the node's sysfs when NVML
starts); the plugin starts NVML again when the driver's devices change. The driver's
moves are the emulated kernel's (the same writes Linux answers), the kubelet the
simulator over real gRPC.
"""

from __future__ import annotations

import logging
import time

import pytest
from support.hostkit import hold

from gpunode.host import pci
from gpunode.host.pciids import PciIds
from gpunode.policy.naming import Naming
from gpunode.policy.workload import Workload
from gpunode.services.backoff import Backoff
from katamgr.pipeline.reconcile import Steps, leave_passthrough, reconcile, revert_all
from nodesim.nvml import FakeNvml
from sandbox_plugin.container import RESOURCE_NAME, NvmlResource
from sandbox_plugin.manager import Mode, PluginManager
from sandbox_plugin.resources import HEALTHY, UNHEALTHY

NAMING = Naming(PciIds.find())
PASSTHROUGH = Steps(workload=Workload.VM_PASSTHROUGH, kata=False, cdi=False)
CONTAINER = Steps(workload=Workload.CONTAINER, kata=False, cdi=False)


def gpus_on(host, driver: str) -> list[str]:
    return sorted(d.bdf for d in pci.scan(host) if d.is_nvidia and d.is_gpu and d.driver == driver)


def offered(state) -> set[str]:
    return {d.id for d in state.devices.get(RESOURCE_NAME, []) if d.health == HEALTHY}


def uuid_of(bdf: str) -> str:
    """The stand-in's UUID for the GPU at ``bdf`` (made from its address)."""
    import uuid

    return f"GPU-{uuid.uuid5(uuid.NAMESPACE_OID, bdf)}"


def group_of(host, bdf: str) -> int:
    return next(d.iommu_group for d in pci.scan(host) if d.bdf == bdf)


@pytest.fixture
def dgx(sim_host):
    """A simulated DGX H100 (8 GPUs on nvidia), its kubelet, and the container plugin on
    it with the NVML stand-in, as ``sandbox-device-plugin --workload container`` runs there."""
    managers: list[PluginManager] = []

    def start(**kwargs):
        host, kubelet = sim_host("dgx-h100")
        nvml = FakeNvml.for_simulated_host(host)
        manager = PluginManager(host, Mode.CONTAINER, nvml=nvml, backoff=Backoff(0.05, 2, 0.4), **kwargs)
        managers.append(manager)
        manager.start()
        return host, kubelet, nvml, manager

    yield start
    for manager in managers:
        manager.stop()


def test_gpus_given_back_after_their_vms_let_go_are_offered_again(dgx):
    """The issue's story: VMs hold 6 of the 8 GPUs when the node is relabelled to
    container; the 2 free ones are offered at once, the other 6 once their VMs end."""
    host, kubelet, nvml, manager = dgx()
    gpus = gpus_on(host, "nvidia")
    assert len(gpus) == 8
    kubelet.wait_for(lambda s: len(offered(s)) == 8)
    reconcile(host, NAMING, PASSTHROUGH, None)  # the node runs VMs: every GPU on vfio-pci
    assert gpus_on(host, "vfio-pci") == gpus
    kubelet.wait_for(lambda s: offered(s) == set(), timeout=5)

    held = gpus[:6]
    for pid, bdf in enumerate(held, start=7000):
        hold(host, group_of(host, bdf), pid)
    left = leave_passthrough(host, NAMING, CONTAINER)
    assert sorted(left.held) == held and set(gpus[6:]) <= set(left.restored)
    kubelet.wait_for(lambda s: offered(s) == {uuid_of(b) for b in gpus[6:]}, timeout=5)

    for pid in range(7000, 7006):  # the VMs end
        for path in sorted(host.path(f"/proc/{pid}").rglob("*"), reverse=True):
            path.unlink() if not path.is_dir() else path.rmdir()
        host.path(f"/proc/{pid}").rmdir()
    leave_passthrough(host, NAMING, CONTAINER)  # the agent's next look (GiveBacks.release_freed)
    assert gpus_on(host, "nvidia") == gpus
    started = time.monotonic()
    kubelet.wait_for(lambda s: offered(s) == {uuid_of(b) for b in gpus}, timeout=5)
    assert time.monotonic() - started < 2, "offered again within a second or so of the bind"
    assert manager.nvml_resource is not None and manager.nvml_resource.unavailable_reason is None


def test_revert_and_an_operators_bind_and_unbind_are_followed(dgx):
    host, kubelet, nvml, _ = dgx()
    gpus = gpus_on(host, "nvidia")
    kubelet.wait_for(lambda s: len(offered(s)) == 8)
    reconcile(host, NAMING, PASSTHROUGH, None)
    kubelet.wait_for(lambda s: offered(s) == set(), timeout=5)

    revert_all(host, PASSTHROUGH, None)  # katamgr revert: every GPU back on nvidia
    kubelet.wait_for(lambda s: offered(s) == {uuid_of(b) for b in gpus}, timeout=5)

    # An operator takes one GPU off the driver by hand, then gives it back.
    gone = gpus[3]
    host.kernel.write(host, "/sys/bus/pci/drivers/nvidia/unbind", gone)
    kubelet.wait_for(lambda s: offered(s) == {uuid_of(b) for b in gpus if b != gone}, timeout=5)
    host.kernel.write(host, "/sys/bus/pci/drivers/nvidia/bind", gone)
    kubelet.wait_for(lambda s: offered(s) == {uuid_of(b) for b in gpus}, timeout=5)


def test_nvml_unavailable_is_tried_again_as_soon_as_the_driver_binds_a_gpu(sim_host, caplog):
    """No GPU on the driver: NVML cannot start (driver not loaded); with its retry an hour
    away, a bind to nvidia starts it at once."""
    host, kubelet = sim_host("dgx-h100")
    reconcile(host, NAMING, PASSTHROUGH, None)
    nvml = FakeNvml.for_simulated_host(host)
    caplog.set_level(logging.INFO, logger="sandbox_plugin.container")
    with PluginManager(host, Mode.CONTAINER, nvml=nvml, nvml_retry_interval=3600):
        state = kubelet.wait_for(lambda s: RESOURCE_NAME in s.devices)
        assert state.devices[RESOURCE_NAME] == []
        revert_all(host, PASSTHROUGH, None)
        kubelet.wait_for(lambda s: len(offered(s)) == 8, timeout=5)
    lines = [r.getMessage() for r in caplog.records]
    assert any("advertising no GPUs" in line and "Driver Not Loaded" in line for line in lines), lines


def test_nvml_starts_again_only_when_the_drivers_devices_changed(dgx, caplog):
    host, kubelet, nvml, manager = dgx()
    resource = manager.nvml_resource
    assert isinstance(resource, NvmlResource)
    kubelet.wait_for(lambda s: len(offered(s)) == 8)
    inits = nvml.init_calls
    # Events that move no device off or onto nvidia: a sysfs attribute, a vfio-pci bind of
    # nothing of the driver's, the safety look.
    host.path("/sys/bus/pci/devices/0000:03:00.0/driver_override").write_text("(null)\n")
    resource.driver_changed()
    time.sleep(0.3)
    assert nvml.init_calls == inits and resource.enumerations == 1

    caplog.set_level(logging.INFO, logger="sandbox_plugin.container")
    host.kernel.write(host, "/sys/bus/pci/drivers/nvidia/unbind", "0000:13:00.0")
    kubelet.wait_for(lambda s: len(offered(s)) == 7, timeout=5)
    assert resource.enumerations == 2
    line = next(r.getMessage() for r in caplog.records if "driver's devices changed" in r.getMessage())
    assert "no longer offered" in line and "0000:13:00.0" in line and "7 GPU(s)" in line


def test_an_xid_mark_outlives_nvmls_restart_unless_the_gpu_left_the_driver(dgx):
    host, kubelet, nvml, _ = dgx()
    kubelet.wait_for(lambda s: len(offered(s)) == 8)
    sick, moved = uuid_of("0000:03:00.0"), uuid_of("0000:04:00.0")

    def health(state):
        return {d.id: d.health for d in state.devices.get(RESOURCE_NAME, [])}

    # An XID reaches only the event sets already registered (as NVML's): raised until seen.
    deadline = time.monotonic() + 5
    while {health(kubelet.state).get(u) for u in (sick, moved)} != {UNHEALTHY}:
        assert time.monotonic() < deadline, health(kubelet.state)
        for uuid in (sick, moved):
            nvml.xid(uuid, 79)
        time.sleep(0.1)

    # 0000:04:00.0 leaves the driver (NVML starts again without it) and comes back: the
    # driver probed it afresh. 0000:03:00.0 never left: still out of service.
    host.kernel.write(host, "/sys/bus/pci/drivers/nvidia/unbind", "0000:04:00.0")
    kubelet.wait_for(lambda s: moved not in health(s), timeout=5)
    host.kernel.write(host, "/sys/bus/pci/drivers/nvidia/bind", "0000:04:00.0")
    state = kubelet.wait_for(lambda s: health(s).get(moved) == HEALTHY, timeout=5)
    assert health(state)[sick] == UNHEALTHY
