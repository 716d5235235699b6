"""Passthrough health on a real kernel: AER errors injected by QEMU's monitor while the guest
runs, counted by the guest kernel's own AER driver and recovered by it; an operator turning a
device's reset methods off; a device a pod holds hot-unplugged. The device plugin (its own
process in the guest) tells the kubelet simulator; guest_health.py records what it saw.

Sources: QEMU 7.2 ``pcie_aer_inject_error`` (hw/pci/pcie_aer.c) and QMP ``device_del``; the
kernel's drivers/pci/pcie/aer.c (the ``aer_dev_*`` files, what it reads of a device after a
fatal error) and drivers/pci/pcie/err.c (recovery, its uevents); drivers/pci/pci.c
(``reset_method``). The figures (fault to Unhealthy) are printed in the suite's summary line,
not asserted: TCG on a shared machine says little about a node.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kernelkit import show

pytestmark = pytest.mark.integration

DATA = Path(__file__).parents[1] / "data" / "kernel" / "aer"


def _health(guest) -> dict:
    step = guest.step("health")
    if "error" in step:
        pytest.fail(f"the health step broke: {step['error']}\nplugin log:\n{step.get('plugin_log', '')[-3000:]}",
                    pytrace=False)
    return step


def _injections(step: dict, kind: str) -> list[dict]:
    found = [i for i in step["injections"] if i["kind"] == kind]
    assert found, step["injections"]
    return found


def test_the_kernel_writes_the_aer_files_as_the_simulated_node_does(guest):
    """The format nodesim.pcierrors writes is the one Debian's kernel wrote (a copy of the
    guest's files is kept in tests/data/kernel/aer)."""
    from nodesim import pcierrors

    written = _health(guest)["aer_files_before"]
    for kind, name in (("correctable", "aer_dev_correctable"), ("nonfatal", "aer_dev_nonfatal"),
                       ("fatal", "aer_dev_fatal")):
        assert written[name] == pcierrors.aer_text(kind, {}), f"{name}:\n{written[name]}"
        assert (DATA / name).read_text() == written[name], f"tests/data copy of {name} is stale"


def test_a_non_fatal_error_is_counted_turns_the_device_unhealthy_and_back_once_the_kernel_recovered_it(guest):
    step = _health(guest)
    for entry in _injections(step, "nonfatal"):
        assert entry["answer"]["ok"], show(entry)
        assert entry["total_after"] == entry["total_before"] + 1, show(entry)  # the kernel's own count
        assert entry["unhealthy_s"] is not None, f"never Unhealthy at the kubelet: {entry}"
        # The kernel's BEGIN_RECOVERY comes first, and the count right after it.
        assert any(w in (entry["reason"] or "") for w in ("recovering", "new non-fatal AER error")), entry
        # drivers/pci/pcie/err.c's SUCCESSFUL_RECOVERY (vfio-pci says it can recover).
        assert entry["healthy_again_s"] is not None, f"never Healthy again: {entry}"
    assert "UnsupReq 3" in step["aer_files_after"]["aer_dev_nonfatal"]


def test_a_fatal_error_is_unhealthy_until_a_reset_reads_the_device_back_sane(guest):
    """6.1 does not read an endpoint after a fatal error ("type=Inaccessible"), so its own
    aer_dev_fatal stays 0; the kernel's BEGIN_RECOVERY uevent says it, and its recovery
    fails under QEMU (the root port's reset: ENOTTY). The hand-back check's reset (FLR through
    sysfs) is what brings the device back."""
    step = _health(guest)
    for entry in _injections(step, "fatal"):
        assert entry["answer"]["ok"], show(entry)
        assert entry["unhealthy_s"] is not None, f"never Unhealthy at the kubelet: {entry}"
        assert "recover" in (entry["reason"] or ""), entry
        assert entry["hand_back"] == {**entry["hand_back"], "ok": True, "reset": "sysfs reset"}, entry
        assert entry["healthy_again_s"] is not None, f"never Healthy again after the reset: {entry}"
    assert any("Uncorrected (Fatal) error message received" in line for line in step["dmesg"]), step["dmesg"]


def test_a_correctable_error_never_makes_the_device_unhealthy(guest):
    (entry,) = _injections(_health(guest), "correctable")
    assert entry["answer"]["ok"], show(entry)
    assert entry["health_after"] == "Healthy", entry


def test_no_usable_reset_method_is_unhealthy_and_the_kernels_defaults_bring_it_back(guest):
    step = _health(guest)
    assert step["reset_off"]["read_back"] == "", step["reset_off"]  # "All device reset methods disabled by user"
    assert step["reset_off"]["unhealthy_s"] is not None, step["reset_off"]
    assert [p[0] for p in step["reset_off"]["reason"]] == ["NoResetMethod"], step["reset_off"]
    assert step["reset_default"]["healthy_s"] is not None, step["reset_default"]


def test_reset_methods_as_the_kernel_lists_them(guest):
    """QEMU's virtio-pci offers FLR unless told not to (x-pcie-flr-init=off); a conventional
    device sharing its bus (the e1000 behind the PCIe-to-PCI bridge) has no method at all,
    so no ``reset_method`` and no ``reset``."""
    step = _health(guest)
    first, second = step["devices"]
    assert step["facts_bound"][first]["reset_methods"] == ["flr", "pm", "bus"], step["facts_bound"]
    assert step["facts_bound"][second]["reset_methods"] == ["pm", "bus"], step["facts_bound"]
    legacy = step["legacy_nic"]
    assert legacy["reset_methods"] is None and not legacy["resettable"], legacy
    assert [p[0] for p in legacy["problems"]] == ["NoResetMethod"], legacy


def test_a_device_hot_unplugged_while_a_pod_holds_it_is_listed_unhealthy(guest):
    unplug = _health(guest)["unplug"]
    assert unplug["answer"]["ok"] and unplug["removed"], unplug
    assert unplug["unhealthy_after_removal_s"] is not None, unplug
    assert [p[0] for p in unplug["facts"]["problems"]] == ["Gone"], unplug
