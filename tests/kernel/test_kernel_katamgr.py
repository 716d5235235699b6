"""katamgr plan, apply and revert on a real kernel, with the stand-in devices selected
by ``--include-device`` (tests/kernel/guest_checks.py runs them; these read what
they did).

Sources: kernel Documentation/driver-api/vfio.rst (binding a device to vfio-pci
makes its group's ``/dev/vfio/$GROUP``; a group is viable only when all its devices
are bound to a VFIO driver or to none) and Documentation/ABI/testing/sysfs-bus-pci
(``driver_override``, ``drivers_probe``, ``<driver>/unbind``, the ``driver`` link).
"""

from __future__ import annotations

import pytest
from kernelkit import group_of, show

pytestmark = pytest.mark.integration

# A refusal is a holder check and an exit, where a blocked unbind waits for as long as
# the VM runs (here: the 180 s the guest gives it). Counted from the command's first log
# record, so the interpreter's start-up is left out; the bound is wide because TCG runs
# Python some 20 to 40 times slower than the host does.
REFUSAL_WORK_S = 30.0


def _stand_ins(guest) -> dict[str, str]:
    return guest.step("facts")["stand_ins"]



def _plan_rows(guest) -> dict[str, dict]:
    plan = guest.step("plan")
    assert "json" in plan, show(plan)
    # The guest's shared group is a problem plan lists, so it exits 4 (katamgr/exitcodes.py).
    assert plan["rc"] == (4 if plan["json"]["problems"] else 0), show(plan)
    return {row["bdf"]: row for row in plan["json"]["devices"]}


def test_plan_sees_the_kernels_iommu_groups(guest):
    rows = _plan_rows(guest)
    for name, bdf in _stand_ins(guest).items():
        assert bdf in rows, f"plan lists no row for the {name} stand-in {bdf}: {sorted(rows)}"
        assert rows[bdf]["iommuGroup"] == group_of(guest, bdf), (
            f"plan puts {name} {bdf} in group {rows[bdf]['iommuGroup']}, the kernel in {group_of(guest, bdf)}")


def test_plan_binds_the_own_group_stand_ins_and_skips_the_shared_group(guest):
    rows, s = _plan_rows(guest), _stand_ins(guest)
    assert rows[s["edu"]]["action"] == "bind", rows[s["edu"]]
    assert rows[s["vga"]]["action"] == "bind", rows[s["vga"]]
    assert rows[s["shared_edu"]]["action"] == "skip", rows[s["shared_edu"]]
    assert rows[s["nic"]]["action"] == "skip", rows[s["nic"]]


def test_apply_binds_the_own_group_stand_ins_to_vfio_pci(guest):
    apply, s = guest.step("apply"), _stand_ins(guest)
    assert apply["rc"] == 4, show(apply)  # done, with the shared group's edu left out (exit 4)
    for name in ("edu", "vga"):
        bdf = s[name]
        assert apply["after"]["drivers"][bdf] == "vfio-pci", f"{name} {bdf}: driver link after apply\n{show(apply)}"
        node = f"/dev/vfio/{group_of(guest, bdf)}"
        assert node in apply["after"]["vfio_nodes"], f"{node} missing after apply: {apply['after']['vfio_nodes']}"


def test_devtmpfs_makes_the_vfio_nodes_without_udev(guest):
    """The container node is world-usable, a group node root's only (vfio.ko's
    devnode callback; no udev rule is involved)."""
    nodes, s = guest.step("apply")["after"]["vfio_nodes"], _stand_ins(guest)
    assert nodes.get("/dev/vfio/vfio") == "0o666", nodes
    assert nodes.get(f"/dev/vfio/{group_of(guest, s['edu'])}") == "0o600", nodes


def test_apply_skips_the_group_shared_with_the_nic_and_says_why(guest):
    apply, s = guest.step("apply"), _stand_ins(guest)
    drivers = apply["after"]["drivers"]
    assert drivers[s["shared_edu"]] is None, f"the shared group's edu was moved: {drivers[s['shared_edu']]}"
    assert drivers[s["nic"]] == "e1000", f"the NIC lost its driver: {drivers[s['nic']]}"
    group = group_of(guest, s["shared_edu"])
    said = apply["stdout"] + apply["stderr"]
    why = [line for line in said.splitlines() if s["shared_edu"] in line and f"group {group}" in line]
    assert why, f"apply does not say why {s['shared_edu']} (IOMMU group {group}) is skipped:\n{show(apply)}"
    assert s["nic"] in why[0] and "e1000" in why[0], f"the reason does not name the NIC: {why[0]}"


def test_a_second_apply_changes_nothing(guest):
    first, again = guest.step("apply"), guest.step("apply_again")
    assert again["rc"] == 4, show(again)  # the shared group is still left out, and said so
    changed = [line for line in again["stdout"].splitlines() if line.startswith("changed:")]
    assert not changed, f"the second apply changed things:\n{show(again)}"
    # Not "nothing to change": a device is still left out, and exit 4 says so.
    assert "nothing to change" not in again["stdout"], show(again)
    assert again["after"] == first["after"], "the host differs after the second apply"


def test_revert_refuses_within_seconds_while_a_vm_holds_the_group(guest):
    held = guest.step("revert_held")
    assert held.get("held_before"), f"the nested QEMU did not hold the group:\n{show(held, 'holder_node', 'error')}"
    assert not held["timed_out"], (
        f"revert hung while {held['holder_node']} was held (the unbind blocked):\n{show(held)}\n"
        f"dmesg: {held.get('dmesg_while_hung')}")
    assert held["rc"] != 0, f"revert claimed success while the group was held:\n{show(held)}"
    assert held["work_s"] is not None and held["work_s"] < REFUSAL_WORK_S, (
        f"revert took {held['work_s']} s after start-up to refuse:\n{show(held, 'seconds', 'startup_s', 'work_s')}")
    said = held["stdout"] + held["stderr"]
    assert str(held["holder_pid"]) in said and held["holder_node"] in said, (
        f"revert does not name the holder (PID {held['holder_pid']}, {held['holder_node']}):\n{show(held)}")
    assert held["after"]["drivers"][held["holder_bdf"]] == "vfio-pci", "the held device left vfio-pci"
    assert held["held_after"], "the VM lost its device"


def test_revert_never_writes_unbind_for_the_held_device(guest):
    """It refuses before writing: an unbind of a held device would make vfio-pci ask
    the VM for it in dmesg (see the blocked-unbind check in test_kernel_qemu.py)."""
    held = guest.step("revert_held")
    assert "unbind_waits" in held, show(held, "error")
    assert not held["unbind_waits"], f"revert wrote unbind for {held['holder_bdf']}: {held['unbind_waits']}"


def test_revert_while_held_still_gives_back_the_free_devices(guest):
    held, originals, s = guest.step("revert_held"), guest.step("original_drivers"), _stand_ins(guest)
    vga = s["vga"]
    assert held["after"]["drivers"][vga] == originals["drivers"][vga], (
        f"{vga} (not held) is on {held['after']['drivers'][vga]} after the refused revert:\n{show(held)}")


def test_revert_succeeds_once_the_holder_has_exited(guest):
    revert = guest.step("revert")
    assert revert["rc"] == 0, show(revert)
    assert not revert["timed_out"], show(revert)


def test_revert_restores_every_original_driver(guest):
    revert, originals = guest.step("revert"), guest.step("original_drivers")
    after = revert["after"]
    assert after["drivers"] == originals["drivers"], {
        bdf: (originals["drivers"].get(bdf), now) for bdf, now in after["drivers"].items()
        if originals["drivers"].get(bdf) != now}
    assert after["vfio_nodes"] == originals["vfio_nodes"] | {"/dev/vfio/vfio": "0o666"}, after["vfio_nodes"]
    assert after["driver_override"] == originals["driver_override"], after["driver_override"]
