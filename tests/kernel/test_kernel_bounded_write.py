"""The bounded write on a real kernel: ``katamgr revert --force`` while a nested QEMU
holds ``/dev/vfio/N`` of the edu stand-in (the guest's ``revert_forced`` step, right
after the refused plain revert, the same QEMU still running).

The kernel fact: writing the device to ``vfio-pci/unbind`` while a user holds it does
not return until the user lets go. Linux 6.1 drivers/vfio/vfio_main.c,
``vfio_unregister_group_dev()`` (called from vfio-pci's remove): it drops its own
registration reference, then loops ``while (rc <= 0)``, calling the driver's
``request`` (vfio-pci relays it to the user over its request eventfd and logs
"Relaying device request to user (#i)", drivers/vfio/pci/vfio_pci_core.c
``vfio_pci_core_request``) and waiting ``HZ * 10`` for ``device->comp``, which
completes only when the last registration reference goes, i.e. when the user closes
the device. The wait is interruptible until the writer gets its first signal (then it
logs "Device is currently in use, task ... blocked until device is released" and waits
uninterruptibly): a writer nobody signals logs nothing but the requests. katamgr's
contract (gpunode/host/kernel.py): writes to ``*/unbind``, ``*/bind`` and
``drivers_probe`` go through a ``dd`` child, bounded by ``LinuxKernel.write_timeout``
(10 s); past it a ``BlockedWrite`` names the pending write and its process, and the
write completes in the kernel by itself once the device is released.

What Debian 6.1 showed: the revert exits 1 about 10 s after its start-up (14 to 16 s
of work under TCG: the bound plus the rest of revert) saying "the kernel did not finish
'<bdf>' written to /sys/bus/pci/drivers/vfio-pci/unbind within 10s ... pending in
process N"; N is ``dd ... of=/sys/bus/pci/drivers/vfio-pci/unbind``, asleep (state S)
with wchan ``vfio_unregister_group_dev`` (stack: unbind_store,
device_release_driver_internal, pci_device_remove, vfio_pci_remove,
vfio_pci_core_unregister_device); dmesg has one "Relaying device request to user (#0)"
and no "blocked until device is released" line. While the write is pending the
device's ``driver`` link and vfio-pci's link to it are already gone (drivers/base/dd.c
``__device_release_driver()`` calls ``driver_sysfs_remove()`` before the driver's
remove), while ``vfio-dev/vfioM`` and ``/dev/vfio/N`` remain and QEMU still holds the
group. Once QEMU is killed, dd exits 0 at once and ``vfio-dev`` and the group node go.
``driver_override`` still says vfio-pci (katamgr stopped at the unbind), and the plain
``katamgr revert`` that follows (the ``revert`` step) clears it and exits 0.

As soon as the write is pending the step also starts ``cat`` of the device's
``driver_override`` and ``katamgr plan``. ``cat`` waits, in state D in
``driver_override_show``, until QEMU is killed, and then reads vfio-pci. ``plan`` does
not wait: the scan reads no attribute that takes the device lock (it once read the
device's ``uevent`` and sat in ``uevent_show`` until QEMU exited), and it ends before
QEMU is killed, its work as long as the unhindered plan's (about 1 s under TCG). The
step times each reader's end from a thread that reaps it, against the moment QEMU is
killed (an earlier version timed it when it looked, after the kill, so a plan that had
long ended seemed to wait for the release).
"""

from __future__ import annotations

import pytest
from kernelkit import show

from gpunode.host.kernel import LinuxKernel

pytestmark = pytest.mark.integration

WRITE_TIMEOUT = LinuxKernel().write_timeout
# Counted from the command's first log record (start-up left out): the bound, plus
# the rest of a revert, which TCG runs some 20 to 40 times slower than the host does.
WORK_MARGIN_S = 20.0
UNBIND = "/sys/bus/pci/drivers/vfio-pci/unbind"


# A plan that waits for the pending unbind ends only after QEMU is killed, 45 s or more
# after it started; one that does not does the work the unhindered plan does (the
# ``plan`` step, about 1 s under TCG), while revert and the readers share the guest's
# two CPUs with it.
PLAN_WORK_FACTOR, PLAN_WORK_MARGIN_S = 3.0, 2.0


def _forced(guest) -> dict:
    step = guest.step("revert_forced")
    assert "error" not in step, show(step, "error")
    assert step["held_before"], f"the nested QEMU did not hold {step['holder_node']} when the revert began"
    return step


def test_forced_revert_returns_within_the_write_bound(guest):
    step = _forced(guest)
    assert not step["timed_out"], f"katamgr revert --force hung (killed after {step['seconds']} s):\n{show(step)}"
    assert step["rc"] == 1, f"expected exit 1 (the unbind did not finish):\n{show(step)}"
    assert step["work_s"] is not None, f"no log record to time the command by:\n{show(step)}"
    assert WRITE_TIMEOUT <= step["work_s"] < WRITE_TIMEOUT + WORK_MARGIN_S, (
        f"revert --force worked {step['work_s']} s after start-up; expected the {WRITE_TIMEOUT:g} s bound "
        f"plus under {WORK_MARGIN_S:g} s:\n{show(step, 'seconds', 'startup_s', 'work_s')}")


def test_forced_revert_names_the_pending_write(guest):
    step = _forced(guest)
    said = step["stdout"] + step["stderr"]
    lines = [line for line in said.splitlines() if "did not finish" in line]
    assert lines, f"revert --force does not say that a write did not finish:\n{show(step)}"
    line = lines[0]
    assert step["holder_bdf"] in line and UNBIND in line and f"within {WRITE_TIMEOUT:g}s" in line, line
    assert step["pending_pid"] is not None and f"pending in process {step['pending_pid']}" in line, line


def test_the_pending_writer_is_katamgrs_dd_waiting_in_vfio_unregister_group_dev(guest):
    step = _forced(guest)
    writer = step["pending_at_exit"]
    assert writer and writer["exists"], f"process {step['pending_pid']} was gone when katamgr exited: {writer}"
    assert writer["cmdline"][0] == "dd" and f"of={UNBIND}" in writer["cmdline"], writer["cmdline"]
    assert writer["state"] in ("S", "D"), f"the writer was not waiting (state {writer['state']})"
    assert writer["wchan"] == "vfio_unregister_group_dev", f"wchan {writer['wchan']}; stack:\n{writer['stack']}"
    assert step["held_at_exit"], "QEMU no longer held the group when katamgr exited"


def test_vfio_pci_asks_the_vm_for_the_device_and_nothing_says_blocked(guest):
    """The request is relayed to QEMU; "blocked until device is released" is logged only
    when the writer is signalled, which nobody does to katamgr's dd."""
    step = _forced(guest)
    bdf, lines = step["holder_bdf"], step["dmesg_while_pending"]
    assert any(bdf in line and "Relaying device request to user" in line for line in lines), lines
    assert not any("blocked until device is released" in line for line in lines), lines


def test_a_pending_unbind_has_already_removed_the_driver_link(guest):
    """While the write waits, sysfs no longer shows the driver; only ``vfio-dev`` and
    the group node (and the holder) tell that vfio-pci still has the device."""
    step = _forced(guest)
    traces = step["at_exit"]
    assert traces["driver"] is None and not traces["vfio_pci_link"], traces
    assert traces["vfio_dev"] and traces["group_node"], traces


def test_the_pending_unbind_completes_once_qemu_exits(guest):
    step = _forced(guest)
    end = step.get("pending_end")
    assert end and end["exited"], f"the pending dd did not end within 30 s of QEMU's: {end}"
    assert end["exit_code"] == 0, f"the pending unbind failed in the kernel (dd exit {end['exit_code']})"
    after = step["after_release"]
    assert after["driver"] is None and not after["vfio_pci_link"], after
    assert not after["vfio_dev"] and not after["group_node"], f"vfio-pci still has the device: {after}"


def test_a_plain_revert_then_restores_the_device(guest):
    forced, revert, originals = _forced(guest), guest.step("revert"), guest.step("original_drivers")
    bdf = forced["holder_bdf"]
    assert revert["rc"] == 0 and not revert["timed_out"], show(revert)
    assert f"restored {bdf}" in revert["stdout"], f"the revert did not restore {bdf}:\n{show(revert)}"
    assert revert["after"]["drivers"][bdf] == originals["drivers"][bdf], revert["after"]["drivers"][bdf]
    assert revert["after"]["driver_override"][bdf] == originals["driver_override"][bdf], (
        revert["after"]["driver_override"])


def _readers(guest) -> dict:
    step = _forced(guest)
    assert step.get("readers"), f"no reader was started while the unbind was pending:\n{show(step, 'pending_pid')}"
    return step["readers"]


def test_reading_driver_override_waits_for_the_pending_unbind(guest):
    """Kernel fact: the unbind holds the device lock for as long as it waits (drivers/
    base/dd.c ``device_release_driver_internal()`` takes ``device_lock()`` around
    ``__device_release_driver()``, whose driver remove is where it waits), and reading
    ``driver_override`` takes that lock (6.1 drivers/pci/pci-sysfs.c
    ``driver_override_show()``; a write does too, drivers/base/driver.c
    ``driver_set_override()``). A mutex: the reader waits uninterruptibly (state D,
    SIGKILL included) until the VM lets go; then it reads vfio-pci. On this kernel
    reading the device's ``uevent`` waits the same way: Debian's 6.1 carries the stable
    backport of "drivers: core: synchronize really_probe() and dev_uevent()", which
    takes ``device_lock()`` in drivers/base/core.c ``uevent_show()`` (mainline later
    dropped it for RCU, 6.11's "driver core: Fix uevent_show() vs driver detach race")."""
    cat = _readers(guest)["cat"]
    assert cat["seen_blocked"] and cat["seen_blocked"]["wchan"] == "driver_override_show", (
        f"cat of driver_override was not seen waiting in driver_override_show: {cat}")
    assert not cat["ended_before_release"] and cat["rc"] == 0, cat
    assert cat["stdout"].strip() == "vfio-pci", cat


def test_katamgr_plan_does_not_wait_for_the_pending_unbind(guest):
    """While the unbind ``katamgr revert --force`` left pending waits for the VM, another
    katamgr command (here ``plan``, started as soon as the write was pending; ``revert``,
    the agent's reconcile and the device plugin's rescan read devices the same way) does
    not wait for it: it is never seen in a sysfs attribute's handler, it ends before QEMU
    is killed, exits 0, lists the held device, and its work takes about as long as the
    unhindered plan's."""
    step = _forced(guest)
    plan = _readers(guest).get("plan")
    assert plan, f"no katamgr plan was run while the unbind was pending: {sorted(step['readers'])}"
    seen = plan["seen_blocked"]
    assert seen is None, (
        f"katamgr plan waited in {seen['wchan']} (state {seen['state']}), seen {seen['after_s']} s after it "
        f"started:\n{seen['stack']}")
    assert plan["ended_before_release"], (
        f"katamgr plan was still running when QEMU was killed, {plan['released_after_s']} s after it started "
        f"(it ended {plan['ended_after_release_s']} s after that); its threads' last samples: "
        f"{plan['threads'][-3:]}\nits Python stacks:\n{plan.get('traceback')}")
    assert plan["rc"] == 4, show(plan)  # the pending unbind is among its problems (exit 4)
    assert "json" in plan, f"katamgr plan printed no JSON:\n{show(plan, 'stdout', 'stderr')}"
    held = {d["bdf"]: d for d in plan["json"]["devices"]}.get(step["holder_bdf"])
    assert held is not None, [d["bdf"] for d in plan["json"]["devices"]]
    # The kernel has dropped the driver link but keeps /dev/vfio/N while QEMU holds it: the
    # plan says the unbind is pending and skips the group, rather than offering a bind that
    # would wait behind it.
    assert held["driver"] is None and held["action"] == "skip", held
    assert held["message"].startswith("an unbind from vfio-pci is still pending for IOMMU group "), held
    assert "qemu" in held["message"], held
    unhindered = guest.step("plan")["work_s"]
    assert plan["work_s"] is not None and unhindered is not None, (plan["work_s"], show(guest.step("plan")))
    bound = unhindered * PLAN_WORK_FACTOR + PLAN_WORK_MARGIN_S
    assert plan["work_s"] <= bound, (
        f"katamgr plan's work took {plan['work_s']} s while the unbind was pending, against {unhindered} s "
        f"without it (bound {bound:.1f} s)")
