"""The device plugin's and the DRA driver's health judge (sandbox_plugin.devhealth) on its own:
what a unit's reason says, what a look that must change nothing (the poll's peek, Allocate's
re-read) leaves, the transitions the metrics count, the kernel's recovery events it follows,
and where a restarted plugin takes up its baseline.

The judge reads a simulated a10-server's sysfs (nodesim.pcierrors writes the faults as Linux
does); the rule it applies is gpunode.policy.health's (tests/gpunode/policy).
"""

from __future__ import annotations

import os
import threading

import pytest
from support.passthroughkit import A10_IDS

from gpunode.host import handback
from gpunode.host.uevents import UEvent
from gpunode.policy.health import HealthPolicy
from nodesim import pcierrors
from nodesim.materialise import materialise
from nodesim.node import open_node
from nodesim.profiles import find_profile
from sandbox_plugin.devhealth import DeviceHealth, HealthPoller

GPU, OTHER = A10_IDS[1], A10_IDS[2]


@pytest.fixture
def host(tmp_path):
    materialise(find_profile("a10-server"), tmp_path / "node")
    return open_node(tmp_path / "node").host


def judge(host, **kwargs) -> tuple[DeviceHealth, list[tuple[str, str, str]]]:
    seen: list[tuple[str, str, str]] = []
    return DeviceHealth(host, on_transition=lambda *t: seen.append(t), **kwargs), seen


def devpath(host, bdf: str) -> str:
    path = os.path.realpath(host.path(f"/sys/bus/pci/devices/{bdf}"))
    return path[path.index("/devices/"):]


def test_a_bad_link_policy_is_refused_naming_it_and_the_choices(host):
    with pytest.raises(ValueError, match="'off' is not one of degrade, warn"):
        DeviceHealth(host, link_policy="off")


def test_a_units_reason_names_each_unfit_device(host):
    health, _ = judge(host)
    assert health.reason([GPU, OTHER]) == ""
    pcierrors.fall_off_bus(host, GPU)
    pcierrors.set_reset_methods(host, OTHER, "")
    reason = health.reason([GPU, OTHER])
    assert reason.startswith(f"{GPU} fell off the bus: its config space reads 0xffff; {OTHER} has no reset method")


def test_each_change_is_one_transition_with_its_reason_code(host):
    health, seen = judge(host)
    health.reason([GPU])
    pcierrors.fall_off_bus(host, GPU)
    health.reason([GPU])
    health.reason([GPU])  # no change: no transition
    HealthPolicy().hand_back(host, GPU, None)  # the reset brings it back; no verdict written
    health.reason([GPU])
    assert seen == [(GPU, "OffTheBus", f"{GPU} fell off the bus: its config space reads 0xffff"), (GPU, "", "")]


def test_a_peek_and_allocates_re_read_see_a_fault_and_change_nothing(host):
    health, seen = judge(host)
    health.reason([GPU])
    pcierrors.inject_aer(host, GPU, "fatal", "DLP")
    assert "new fatal AER" in health.recheck([GPU])  # the watched files changed: judged in full
    assert "new fatal AER" in health.reason([GPU], peek=True)
    assert seen == []  # nothing published
    assert "new fatal AER" in health.reason([GPU])  # the poll's look publishes it
    assert [code for _, code, _ in seen] == ["AerFatal"]


def test_allocates_re_read_keeps_the_last_verdict_while_nothing_changed(host):
    health, _ = judge(host)
    pcierrors.inject_aer(host, GPU, "nonfatal", "CmpltTO")
    health.reason([GPU])  # the first judgement accepts today's counts
    assert health.recheck([GPU]) == ""
    pcierrors.inject_aer(host, GPU, "nonfatal", "CmpltTO")
    assert "1 new non-fatal" in health.recheck([GPU])


def test_a_restarted_plugin_starts_from_the_last_good_hand_back(host):
    """Errors counted after the agent's last good hand-back are still new to a plugin that
    starts afterwards; without a verdict, the counts it finds are accepted."""
    handback.write_verdict(host, HealthPolicy().hand_back(host, GPU, None))
    pcierrors.inject_aer(host, GPU, "nonfatal", "CmpltTO")
    pcierrors.inject_aer(host, OTHER, "nonfatal", "CmpltTO")
    health, _ = judge(host)
    assert "1 new non-fatal" in health.reason([GPU])
    assert health.reason([OTHER]) == ""


def test_the_kernels_recovery_events_are_followed_for_its_devices_only(host):
    health, seen = judge(host)
    health.reason([GPU, OTHER])
    ours = devpath(host, GPU)
    assert not health.heard(UEvent("change", "pci", ours, "vfio-pci", None))  # not about recovery
    assert not health.heard(UEvent("change", "pci", "/devices/pci0000:00/0000:00:09.0/0000:99:00.0",
                                   "vfio-pci", "BEGIN_RECOVERY"))  # a device it does not follow
    assert health.heard(UEvent("change", "pci", ours, "vfio-pci", "BEGIN_RECOVERY"))
    assert health.reason([GPU]) == f"the kernel is recovering {GPU} from a PCIe error"
    port = ours.rsplit("/", 1)[0]  # the root port above it: drivers/pci/pcie/err.c reports there
    assert health.heard(UEvent("change", "pci", port, "pcieport", "FAILED_RECOVERY"))
    assert "could not recover" in health.reason([GPU])
    assert health.reason([OTHER]) == ""  # behind its own port
    assert [code for _, code, _ in seen] == ["AerRecovery"]


def test_the_poller_asks_for_a_rescan_when_a_verdict_would_change(host):
    health, _ = judge(host)
    published = {"gpu": ((GPU,), "")}
    changed = threading.Event()
    poller = HealthPoller(health, lambda: published, changed.set, interval=0.02)
    assert not poller.differs()
    poller.start()
    try:
        assert not changed.wait(0.1)
        pcierrors.train_link(host, GPU, "Unknown", 0)
        assert changed.wait(1.0)
    finally:
        poller.stop()


def test_a_verdict_from_a_judge_under_degrade_is_not_held_against_a_gpu_under_warn(host):
    pcierrors.limit_link(host, GPU, "16.0 GT/s PCIe", 8)
    handback.write_verdict(host, HealthPolicy("degrade").hand_back(host, GPU, None))
    assert DeviceHealth(host, link_policy="warn").reason([GPU]) == ""
    assert "trained below its maximum" in DeviceHealth(host, link_policy="degrade").reason([GPU])

