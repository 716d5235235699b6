"""Product bugs the real kernel shows, kept as strict expected failures: each test
states the behaviour katamgr should have and fails today; when a fix lands it passes,
strict xfail turns that into a failure, and the marker is to be removed.

Not marked ``integration``: tests/conftest.py reports a skipped integration test as
a failure under REQUIRE_INTEGRATION=1, and pytest counts an xfail as skipped. The
``guest`` fixture still fails outright under REQUIRE_INTEGRATION=1 when the guest
cannot run, and only an AssertionError counts as the expected failure.
"""

from __future__ import annotations

import pytest


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "product bug: katamgr's device scan (katamgr.host.pci.scan -> read_device) reads a device's "
    "uevent (other vendors) or driver_override (NVIDIA), and both wait in the kernel, "
    "uninterruptibly, while an unbind of that device is pending; vfio._restore's driver_override "
    "write (kernel._MAY_BLOCK: 'never blocks') would too"))
def test_katamgr_plan_does_not_wait_for_a_pending_unbind(guest):
    """While the unbind ``katamgr revert --force`` left pending waits for the VM (see
    test_kernel_bounded_write.py), another katamgr command (here ``plan``, started as
    soon as the write was pending; ``revert``, the agent's reconcile and the device
    plugin's rescan read devices the same way) must not wait for it too. On Debian's
    6.1 it does: it sleeps in ``uevent_show`` (state D, unkillable) until QEMU exits.
    The stand-in is not NVIDIA's, so the scan reads its ``uevent``; for an NVIDIA GPU
    it reads ``driver_override``, which waits on every kernel since 4.13 (see
    test_reading_driver_override_waits_for_the_pending_unbind)."""
    step = guest.step("revert_forced")
    plan = (step.get("readers") or {}).get("plan")
    if plan is None:
        pytest.fail(f"no katamgr plan was run while the unbind was pending: {sorted(step)}", pytrace=False)
    seen = plan["seen_blocked"]
    assert seen is None, (
        f"katamgr plan waited in {seen['wchan']} (state {seen['state']}), seen {seen['after_s']} s after it "
        f"started, until QEMU exited (it ended {plan['ended_after_release_s']} s after that):\n{seen['stack']}")
    assert plan["ended_before_release"] and plan["rc"] == 0, plan
