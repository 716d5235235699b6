"""A passthrough GPU's health from what the host kernel sees: AER counts, its link, its config
space, its reset methods and the agent's hand-back verdict (sandbox_plugin.devhealth, judging
by gpunode.policy.health).

The simulated node's sysfs carries the files as Linux writes them (nodesim.pcierrors, from
what tests/kernel recorded on Debian's 6.1 kernel); a fault is what the kernel's AER driver,
a retrained link or a GPU fallen off the bus leaves there. Each test reads the health the
kubelet (the simulator, over real gRPC) or the API server's ResourceSlice gets.
"""

from __future__ import annotations

import os
import time

import grpc
import pytest
from drakit import make_node
from test_passthrough_plugin import A10, A10_IDS, FAST, NAMING, bind, health

from gpunode.host import handback
from gpunode.host.uevents import UEvent
from gpunode.policy.health import HealthPolicy
from nodesim import pcierrors
from sandbox_plugin.manager import Mode, PluginManager
from sandbox_plugin.resources import HEALTHY, UNHEALTHY

GPU = A10_IDS[1]  # 0000:31:00.0
POLICY = HealthPolicy()  # the agent's hand-back check, under the plugin's default link policy


@pytest.fixture
def a10(sim_host):
    """An a10-server bound to vfio-pci, its plugin serving: (host, kubelet, manager)."""
    managers: list[PluginManager] = []

    def start(link_policy: str = "degrade", health_interval: float = 0.05):
        host, kubelet = sim_host("a10-server")
        bind(host)
        manager = PluginManager(host, Mode.VM_PASSTHROUGH, naming=NAMING, backoff=FAST,
                                link_policy=link_policy, health_interval=health_interval)
        managers.append(manager)
        manager.start()
        kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4)
        return host, kubelet, manager

    yield start
    for manager in managers:
        manager.stop()


def unit(manager, unit_id: str = GPU):
    return next(u for u in manager.discovery.resources[A10].units() if u.id == unit_id)


def turns(kubelet, value: str, unit_id: str = GPU, timeout: float = 1.0) -> float:
    """Seconds until the kubelet lists the unit with ``value``; fails past ``timeout``."""
    started = time.monotonic()
    kubelet.wait_for(lambda s: health(s, A10).get(unit_id) == value, timeout=timeout)
    return time.monotonic() - started


def test_a_fatal_aer_error_makes_the_gpu_unhealthy_until_a_hand_back_reset_reads_it_back_sane(a10):
    host, kubelet, manager = a10()
    pcierrors.inject_aer(host, GPU, "fatal", "DLP")
    turns(kubelet, UNHEALTHY)
    assert unit(manager).reason == f"{GPU} reported 1 new fatal AER error(s) (the kernel's counts: DLP 1)"
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.allocate(A10, [GPU])
    assert "new fatal AER" in refused.value.details()
    # The counts never go down; a reset that reads back sane is what ends it.
    verdict = POLICY.hand_back(host, GPU, None)
    assert verdict is not None and verdict.ok, verdict
    handback.write_verdict(host, verdict)
    turns(kubelet, HEALTHY)
    assert sorted(kubelet.state.healthy(A10)) == A10_IDS


def test_allocate_refuses_a_gpu_that_faulted_since_the_last_poll(a10):
    """ListAndWatch says Unhealthy within a poll; a kubelet that picked the GPU just before
    must not be handed it: Allocate reads the facts of what it hands out again."""
    host, kubelet, manager = a10(health_interval=3600)  # no poll during the test
    pcierrors.inject_aer(host, GPU, "fatal", "DLP")
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.allocate(A10, [GPU])
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"{GPU} reported 1 new fatal AER error(s)" in refused.value.details()
    pcierrors.fall_off_bus(host, A10_IDS[0])
    with pytest.raises(grpc.RpcError) as off:
        kubelet.allocate(A10, [A10_IDS[0]])
    assert "fell off the bus" in off.value.details()
    assert kubelet.allocate(A10, [A10_IDS[2]])  # the others are handed out as before


def test_a_non_fatal_error_ends_when_the_kernel_says_the_device_recovered(a10):
    host, kubelet, manager = a10()
    pcierrors.inject_aer(host, GPU, "nonfatal", "CmpltTO", 2)
    turns(kubelet, UNHEALTHY)
    assert unit(manager).reason == f"{GPU} reported 2 new non-fatal AER error(s) (the kernel's counts: CmpltTO 2)"
    # drivers/pci/pcie/err.c sends this on the device once its drivers resumed.
    heard = manager.discovery.health.heard(UEvent("change", "pci", f"/devices/pci0000:00/0000:30:00.0/{GPU}",
                                                  "vfio-pci", "SUCCESSFUL_RECOVERY"))
    assert heard
    turns(kubelet, HEALTHY)
    # A new error after that trips it again.
    pcierrors.inject_aer(host, GPU, "nonfatal", "CmpltTO")
    turns(kubelet, UNHEALTHY)


def test_a_re_enumerated_gpu_is_judged_from_its_new_counts(a10):
    """After remove and rescan (or a hot-plug) the kernel's counts start again at zero: the
    baseline of the device that was there before must not hide the new one's errors."""
    host, kubelet, manager = a10()
    pcierrors.inject_aer(host, GPU, "nonfatal", "CmpltTO", 2)
    turns(kubelet, UNHEALTHY)
    manager.discovery.health.heard(UEvent("change", "pci", f"/devices/pci0000:00/0000:30:00.0/{GPU}",
                                          "vfio-pci", "SUCCESSFUL_RECOVERY"))
    turns(kubelet, HEALTHY)  # the baseline is now 2
    pcierrors.re_enumerate(host, GPU)
    pcierrors.inject_aer(host, GPU, "nonfatal", "CmpltTO")  # before a poll: the identity tells
    turns(kubelet, UNHEALTHY)
    assert unit(manager).reason == f"{GPU} reported 1 new non-fatal AER error(s) (the kernel's counts: CmpltTO 1)"
    # Again, with the polls seeing the new device at zero before it reports anything.
    manager.discovery.health.heard(UEvent("change", "pci", f"/devices/pci0000:00/0000:30:00.0/{GPU}",
                                          "vfio-pci", "SUCCESSFUL_RECOVERY"))
    turns(kubelet, HEALTHY)
    pcierrors.inject_aer(host, GPU, "nonfatal", "CmpltTO", 3)  # the baseline is now 1: 4 counted
    turns(kubelet, UNHEALTHY)
    manager.discovery.health.heard(UEvent("change", "pci", f"/devices/pci0000:00/0000:30:00.0/{GPU}",
                                          "vfio-pci", "SUCCESSFUL_RECOVERY"))
    turns(kubelet, HEALTHY)  # the baseline is now 4
    pcierrors.re_enumerate(host, GPU)
    time.sleep(0.3)  # polls see the new device at zero
    assert health(kubelet.state, A10)[GPU] == HEALTHY
    pcierrors.inject_aer(host, GPU, "nonfatal", "CmpltTO", 2)
    turns(kubelet, UNHEALTHY)


def test_correctable_errors_are_counted_not_fatal(a10):
    host, kubelet, manager = a10()
    pcierrors.inject_aer(host, GPU, "correctable", "BadTLP", 50)
    time.sleep(0.3)  # several polls
    assert health(kubelet.state, A10)[GPU] == HEALTHY


def test_a_gpu_off_the_bus_is_unhealthy_and_back_after_a_reset(a10):
    host, kubelet, manager = a10()
    pcierrors.fall_off_bus(host, GPU)
    turns(kubelet, UNHEALTHY)
    assert unit(manager).reason == f"{GPU} fell off the bus: its config space reads 0xffff"
    verdict = POLICY.hand_back(host, GPU, None)
    assert verdict.ok, verdict
    turns(kubelet, HEALTHY)


def test_a_reset_that_fails_keeps_the_gpu_out_with_the_reason(a10):
    host, kubelet, manager = a10()
    pcierrors.fall_off_bus(host, GPU)
    pcierrors.fail_reset(host, GPU)
    verdict = POLICY.hand_back(host, GPU, None)
    assert not verdict.ok and "its reset failed" in verdict.reason
    handback.write_verdict(host, verdict)
    turns(kubelet, UNHEALTHY)
    assert "fell off the bus" in unit(manager).reason  # the most serious fact first


def test_a_degraded_link_is_unhealthy_or_only_a_warning_as_configured(a10):
    host, kubelet, manager = a10()
    pcierrors.train_link(host, GPU, "8.0 GT/s PCIe", 16)
    turns(kubelet, UNHEALTHY)
    assert unit(manager).reason == (f"{GPU}'s PCIe link trained below its maximum: "
                                    "8.0 GT/s PCIe x16 (max 16.0 GT/s PCIe x16)")
    pcierrors.train_link(host, GPU)  # retrained at its maximum
    turns(kubelet, HEALTHY)

    host, kubelet, manager = a10(link_policy="warn")
    pcierrors.train_link(host, GPU, "16.0 GT/s PCIe", 8)
    time.sleep(0.3)
    assert health(kubelet.state, A10)[GPU] == HEALTHY
    pcierrors.train_link(host, GPU, "Unknown", 0)  # a link that is down is never only a warning
    turns(kubelet, UNHEALTHY)


def test_a_gpu_without_a_reset_method_is_unhealthy(a10):
    host, kubelet, manager = a10()
    pcierrors.set_reset_methods(host, GPU, "")  # an operator turned them all off
    turns(kubelet, UNHEALTHY)
    assert "no reset method the kernel can use (reset_method is empty)" in unit(manager).reason
    pcierrors.set_reset_methods(host, GPU, "bus")
    turns(kubelet, HEALTHY)


def test_each_transition_is_counted_by_reason(a10):
    host, kubelet, manager = a10()
    pcierrors.fall_off_bus(host, GPU)
    turns(kubelet, UNHEALTHY)
    POLICY.hand_back(host, GPU, None)
    turns(kubelet, HEALTHY)
    counts = {labels: child.value for labels, child in manager.metrics.health_transitions.snapshot()}
    assert counts == {(GPU, "Unhealthy", "OffTheBus"): 1, (GPU, "Healthy", ""): 1}


def test_a_gpu_gone_from_the_host_while_a_pod_holds_it_stays_listed_unhealthy(a10):
    host, kubelet, manager = a10()
    kubelet.admit_pod("default", "vm", {"vm": {A10: 1}})
    (held,) = kubelet.state.pods[0].containers[0].devices[A10]
    link = host.path(f"/sys/bus/pci/devices/{held}")
    link.unlink()  # what the kernel's hot-remove leaves in /sys/bus/pci/devices
    turns(kubelet, UNHEALTHY, held, timeout=2)
    assert "is gone from the host" in unit(manager, held).reason


def test_the_dra_driver_takes_an_unhealthy_gpu_out_of_the_slice():
    node, cleanup = make_node()
    try:
        node.driver.wait_synced(0)
        name = "gpu-0000-03-00-0"
        assert name in node.device_names()
        pcierrors.inject_aer(node.host, "0000:03:00.0", "fatal", "MalfTLP")
        deadline = time.monotonic() + 2
        while name in node.device_names() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert name not in node.device_names()
        POLICY.hand_back(node.host, "0000:03:00.0", None)
        handback.write_verdict(node.host, POLICY.hand_back(node.host, "0000:03:00.0", None))
        deadline = time.monotonic() + 2
        while name not in node.device_names() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert name in node.device_names()
    finally:
        cleanup()


def test_the_kernels_error_recovery_events_are_followed(a10):
    """drivers/pci/pcie/err.c: BEGIN_RECOVERY on the device, then SUCCESSFUL_RECOVERY on it,
    or FAILED_RECOVERY on the port above it (a 6.1 kernel does not count an endpoint's fatal
    error in its own aer_dev_fatal: tests/kernel)."""
    host, kubelet, manager = a10()
    path = os.path.realpath(host.path(f"/sys/bus/pci/devices/{GPU}"))
    devpath = path[path.index("/devices/"):]
    port = devpath.rsplit("/", 2)[-2]
    health = manager.discovery.health
    # The watcher's call: Unhealthy at once, before any sysfs read (a reset keeps those waiting).
    manager.discovery.heard(UEvent("change", "pci", devpath, "vfio-pci", "BEGIN_RECOVERY"))
    assert unit(manager).health == UNHEALTHY  # already, in the caller's thread
    turns(kubelet, UNHEALTHY)
    assert unit(manager).reason == f"the kernel is recovering {GPU} from a PCIe error"
    assert health.heard(UEvent("change", "pci", devpath.rsplit("/", 1)[0], "pcieport", "FAILED_RECOVERY"))
    kubelet.wait_for(lambda s: "could not recover" in unit(manager).reason, timeout=1)
    assert port in devpath
    handback.write_verdict(host, POLICY.hand_back(host, GPU, None))  # a reset that reads back sane
    turns(kubelet, HEALTHY)
    health.heard(UEvent("change", "pci", devpath, "vfio-pci", "BEGIN_RECOVERY"))
    turns(kubelet, UNHEALTHY)
    health.heard(UEvent("change", "pci", devpath, "vfio-pci", "SUCCESSFUL_RECOVERY"))
    turns(kubelet, HEALTHY)
