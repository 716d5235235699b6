"""Binding to vfio-pci and back on simulated hosts, as a kernel would see it."""

from __future__ import annotations

import json

import pytest
from support.hostkit import (
    AUDIO_A6000,
    GPU_A10,
    GPU_A6000,
    dev,
    driver_of,
    hold,
    make_host,
    snapshot,
    tune,
)
from support.paths import HOST_PROFILES

from gpunode.host.pciids import PciIds
from gpunode.policy.naming import Naming
from katamgr.pipeline.devices import apply_host, revert_host
from katamgr.pipeline.plan import build_plan
from nodesim.materialise import materialise
from nodesim.profile import load_profile

NAMING = Naming(PciIds.find())


def plan_and_apply(host, **kw):
    return apply_host(host, build_plan(host, NAMING, force=kw.pop("force", False)), **kw)


@pytest.mark.parametrize("profile_path", HOST_PROFILES, ids=lambda p: p.stem)
def test_bind_revert_bind_leaves_sysfs_as_a_kernel_would(tmp_path, profile_path):
    host = materialise(load_profile(profile_path), tmp_path / "host")
    before = snapshot(host)
    assert plan_and_apply(host).ok
    bound = snapshot(host)
    for d in build_plan(host, NAMING).devices:
        if d.action != "skip":
            assert d.driver == d.vfio_driver and d.vfio_driver in ("vfio-pci", "nvgrace_gpu_vfio_pci")
            assert host.path(f"/dev/vfio/{d.iommu_group}").exists()
    assert revert_host(host).ok
    after = snapshot(host)
    # Loading vfio-pci (or a variant driver) leaves the module (and /dev/vfio/vfio) in
    # place, as on Linux.
    loaded = {k for k in after.keys() - before.keys() if "vfio" in k or k == "sys/module"}
    assert {k: v for k, v in after.items() if k not in loaded} == before
    assert plan_and_apply(host).ok
    assert snapshot(host) == bound


def test_second_apply_changes_nothing(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4)])
    assert plan_and_apply(host).changes
    again = plan_and_apply(host)
    assert again.ok and again.changes == []


def test_device_already_on_vfio_is_left_alone_and_not_recorded(tmp_path):
    host = make_host(tmp_path, [
        dev("0000:01:00.0", GPU_A10, "vfio-pci", 4),
        dev("0000:02:00.0", GPU_A10, "nvidia", 5),
    ])
    override = host.path("/sys/bus/pci/devices/0000:01:00.0/driver_override")
    stamp = override.stat().st_mtime_ns
    plan = build_plan(host, NAMING)
    assert {d.bdf: d.action for d in plan.devices} == {"0000:01:00.0": "keep", "0000:02:00.0": "bind"}
    report = apply_host(host, plan)
    assert not any("0000:01:00.0" in c for c in report.changes)
    assert override.stat().st_mtime_ns == stamp
    state = json.loads(host.state_path("vfio.json").read_text())
    assert set(state["devices"]) == {"0000:02:00.0"}
    assert state["devices"]["0000:02:00.0"]["driver"] == "nvidia"
    revert_host(host)
    # Revert restores what we moved, and leaves what was on vfio-pci before.
    assert driver_of(host, "0000:01:00.0") == "vfio-pci"
    assert driver_of(host, "0000:02:00.0") == "nvidia"


def test_graphics_gpu_and_audio_move_together_and_come_back(tmp_path):
    host = make_host(tmp_path, [
        dev("0000:01:00.0", GPU_A6000, "nvidia", 15),
        dev("0000:01:00.1", AUDIO_A6000, "snd_hda_intel", 15),
    ])
    assert plan_and_apply(host).ok
    assert driver_of(host, "0000:01:00.0") == driver_of(host, "0000:01:00.1") == "vfio-pci"
    revert_host(host)
    assert driver_of(host, "0000:01:00.0") == "nvidia"
    assert driver_of(host, "0000:01:00.1") == "snd_hda_intel"
    assert host.path("/sys/bus/pci/devices/0000:01:00.0/driver_override").read_text() == "(null)\n"


def test_failure_halfway_rolls_back_the_group(tmp_path):
    host = make_host(tmp_path, [
        dev("0000:01:00.0", GPU_A6000, "nvidia", 15),
        dev("0000:01:00.1", AUDIO_A6000, "snd_hda_intel", 15),
        dev("0000:02:00.0", GPU_A10, "nvidia", 16),
    ])
    before = snapshot(host)
    tune(host, fail_probe=["0000:01:00.1"])
    report = plan_and_apply(host)
    assert not report.ok
    assert "IOMMU group 15" in report.failures[0] and "rolled back" in report.failures[0]
    assert "0000:01:00.1" in report.failures[0]
    assert driver_of(host, "0000:01:00.0") == "nvidia"
    assert driver_of(host, "0000:01:00.1") == "snd_hda_intel"
    # The other group still went through; no readiness claimed after a failure.
    assert driver_of(host, "0000:02:00.0") == "vfio-pci"
    assert not host.path("/run/nvidia/validations/vfio-pci-ready").exists()
    state = json.loads(host.state_path("vfio.json").read_text())
    assert set(state["devices"]) == {"0000:02:00.0"}
    revert_host(host)
    assert snapshot(host) == before


def test_gpu_in_use_is_not_unbound_unless_forced(tmp_path):
    host = make_host(
        tmp_path,
        [dev("0000:01:00.0", GPU_A10, "nvidia", 4, minor=0), dev("0000:02:00.0", GPU_A10, "nvidia", 5, minor=1)],
        processes=[{"pid": 4242, "comm": "python3", "holds": ["/dev/nvidia0", "/dev/nvidiactl"]}],
    )
    plan = build_plan(host, NAMING)
    busy = next(d for d in plan.devices if d.bdf == "0000:01:00.0")
    assert busy.action == "skip" and "PID 4242 (python3)" in busy.reason and "--force" in busy.reason
    apply_host(host, plan)
    assert driver_of(host, "0000:01:00.0") == "nvidia"
    assert driver_of(host, "0000:02:00.0") == "vfio-pci"
    assert plan_and_apply(host, force=True).ok
    assert driver_of(host, "0000:01:00.0") == "vfio-pci"


def test_vfio_pci_is_loaded_when_missing(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4)], vfio_pci="loadable")
    report = plan_and_apply(host)
    assert report.changes[0] == "loaded the vfio-pci module"
    assert driver_of(host, "0000:01:00.0") == "vfio-pci"


def test_vfio_pci_unavailable_fails_clearly_and_changes_nothing(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4)], vfio_pci="missing")
    before = snapshot(host)
    plan = build_plan(host, NAMING)
    assert any("vfio-pci is not loaded" in p for p in plan.problems)
    with pytest.raises(Exception, match="vfio-pci"):
        apply_host(host, plan)
    assert snapshot(host) == before


def test_slow_udev_is_waited_for(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4)])
    tune(host, udev_delay_ms=200)
    assert plan_and_apply(host, wait=5).ok
    assert host.path("/dev/vfio/4").exists()


def test_missing_vfio_node_after_wait_rolls_back(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4)])
    tune(host, udev_delay_ms=2000)
    report = plan_and_apply(host, wait=0.1)
    assert not report.ok and "/dev/vfio/4 did not appear" in report.failures[0]
    assert driver_of(host, "0000:01:00.0") == "nvidia"


def test_readiness_files_written_and_removed(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4)])
    plan_and_apply(host)
    assert host.path("/run/nvidia/validations/workload-type").read_text() == "vm-passthrough\n"
    assert host.path("/run/nvidia/validations/vfio-pci-ready").exists()
    revert_host(host)
    assert not host.path("/run/nvidia/validations/vfio-pci-ready").exists()


def test_revert_leaves_a_device_someone_else_moved(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4)], vfio_pci="loaded")
    plan_and_apply(host)
    from nodesim import kernel

    kernel.create_driver_dir(host, "other")
    kernel.handle_write(host, "/sys/bus/pci/drivers/vfio-pci/unbind", "0000:01:00.0")
    kernel.handle_write(host, "/sys/bus/pci/devices/0000:01:00.0/driver_override", "other")
    kernel.handle_write(host, "/sys/bus/pci/drivers_probe", "0000:01:00.0")
    report = revert_host(host)
    assert not report.ok and "now on other" in report.failures[0]
    assert driver_of(host, "0000:01:00.0") == "other"


def test_revert_leaves_a_gpu_a_vm_holds_unless_forced(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4), dev("0000:02:00.0", GPU_A10, "nvidia", 5)])
    assert plan_and_apply(host).ok
    # A QEMU of a running Kata VM holds group 4's VFIO node.
    hold(host, 4)
    report = revert_host(host)
    assert not report.ok
    assert "0000:01:00.0 is in use by PID 7777 (qemu-system-x86) holding /dev/vfio/4" in report.failures[0]
    assert driver_of(host, "0000:01:00.0") == "vfio-pci"
    assert driver_of(host, "0000:02:00.0") == "nvidia"
    assert revert_host(host, force=True).ok
    assert driver_of(host, "0000:01:00.0") == "nvidia"


def _hold(host, pid: int, comm: str, node: str) -> None:
    """A process with ``node`` open, as /proc shows it (fd links to the node)."""
    fd_dir = host.path(f"/proc/{pid}/fd")
    fd_dir.mkdir(parents=True)
    (fd_dir.parent / "comm").write_text(comm + "\n")
    (fd_dir / "12").symlink_to(node)


def test_a_gpu_taken_into_use_after_the_plan_is_not_unbound(tmp_path):
    """Holders are looked at right before the unbind write, not only when planning:
    the nvidia driver would make the writer wait until the CUDA process lets go."""
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4, minor=0)])
    plan = build_plan(host, NAMING)
    assert [d.action for d in plan.devices] == ["bind"]
    _hold(host, 4242, "python3", "/dev/nvidia0")
    report = apply_host(host, plan)
    assert not report.ok
    assert "0000:01:00.0 is in use by PID 4242 (python3) holding /dev/nvidia0" in report.failures[0]
    assert "rolled back" in report.failures[0]
    assert driver_of(host, "0000:01:00.0") == "nvidia"


def test_revert_checks_the_group_right_before_unbinding(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4)])
    assert plan_and_apply(host).ok
    _hold(host, 7777, "qemu-system-x86", "/dev/vfio/4")
    report = revert_host(host)
    assert "0000:01:00.0 is in use by PID 7777" in report.failures[0]
    assert [h.pid for h in report_held(host)] == [7777]
    assert driver_of(host, "0000:01:00.0") == "vfio-pci"


def report_held(host):
    from gpunode.host import vfio

    return vfio.unbind_all(host).held["0000:01:00.0"]


def test_a_group_whose_unbind_is_still_pending_is_skipped_naming_its_holder(tmp_path):
    """The state a real kernel shows while an unbind from vfio-pci waits for a VM
    (tests/kernel, revert --force under a QEMU): the device has no driver link any more,
    but /dev/vfio/<group> is still there, held. A bind now would only wait behind that
    unbind, so the plan skips the group, even forced, and says who holds it."""
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, None, 4), dev("0000:02:00.0", GPU_A10, "nvidia", 5)])
    host.path("/dev/vfio").mkdir(parents=True, exist_ok=True)
    host.path("/dev/vfio/4").write_text("")
    held = hold(host, 4)
    for force in (False, True):
        decisions = {d.group: d for d in build_plan(host, NAMING, force=force).decisions}
        pending = decisions[4]
        assert pending.action.value == "skip", pending
        assert pending.reason.startswith("an unbind from vfio-pci is still pending for IOMMU group 4: "
                                         "/dev/vfio/4 is still held by PID 7777 (qemu-system-x86)")
        assert decisions[5].action.value == "bind"
    plan_and_apply(host)  # binds group 5, leaves group 4 as it is
    assert driver_of(host, "0000:01:00.0") is None and driver_of(host, "0000:02:00.0") == "vfio-pci"
    # Once the VM lets go the kernel removes the node, and the next run binds the group.
    host.path("/dev/vfio/4").unlink()
    held.unlink()
    assert plan_and_apply(host).ok
    assert driver_of(host, "0000:01:00.0") == "vfio-pci"
