"""Kernel uevents on a real kernel: what the kernel announces when a device binds to
vfio-pci and unbinds, heard through ``gpunode.host.uevents.open_kernel_events()``
(pyudev's netlink monitor, source "kernel"; no udev runs in the guest), which the
device plugin's watcher uses first (sandbox_plugin/watch.py ``DeviceWatcher``).

The guest's ``uevents`` step binds the shared group's edu (free then) with the writes
katamgr makes (``driver_override`` = vfio-pci, ``drivers_probe``) and unbinds it
(``vfio-pci/unbind``, ``driver_override`` cleared), recording what the product's
filtered socket gave (``UEvent(action, subsystem, devpath, driver)``) and, for
comparison, every kernel uevent of any subsystem. What Debian's 6.1 kernel
(6.1.0-56-amd64) sent, all of it, for 0000:04:01.0 in IOMMU group 9 (nothing of any
other subsystem; the filter dropped nothing):

    drivers_probe:   add     vfio      /devices/virtual/vfio/9
                     add     vfio-dev  /devices/pci0000:00/0000:00:05.0/0000:03:00.0/0000:04:01.0/vfio-dev/vfio2
                     bind    pci       /devices/pci0000:00/0000:00:05.0/0000:03:00.0/0000:04:01.0  DRIVER=vfio-pci
    vfio-pci/unbind: remove  vfio-dev  .../0000:04:01.0/vfio-dev/vfio2
                     remove  vfio      /devices/virtual/vfio/9
                     unbind  pci       .../0000:04:01.0  (no DRIVER)

each queued on the socket by the time the write returned (the kernel broadcasts a
uevent from the writer's own context; the watcher heard them within tens of ms).

Sources. Documentation/ABI/testing/sysfs-uevent documents the ``uevent`` file and the
ACTION of a *synthetic* uevent (add, change, remove) only; what a bind sends is the
code's, stable since 4.14: include/linux/kobject.h ``enum kobject_action`` (KOBJ_BIND,
KOBJ_UNBIND; their names in lib/kobject_uevent.c ``kobject_actions``);
drivers/base/dd.c ``driver_bound()`` sends KOBJ_BIND once probe has succeeded, and
``__device_release_driver()`` sends KOBJ_UNBIND after the driver's remove and after
clearing ``dev->driver``; drivers/base/core.c ``dev_uevent()`` adds ``DRIVER=`` only
while ``dev->driver`` is set (so bind carries it, unbind does not). Linux 6.1
drivers/vfio/vfio_main.c: vfio-pci's probe registers the device with VFIO, which
creates its group's device (class ``vfio``, named by the group number, no parent:
``/devices/virtual/vfio/N``, devtmpfs node ``/dev/vfio/N``) when it is the group's
first VFIO device, and a ``vfio-dev`` device ``vfioM`` under the PCI device (the
class 6.1 added for every VFIO device, with or without iommufd); removal undoes both,
the group's when its last VFIO device goes. Probe (and so the ``add`` events) comes
before ``driver_bound()``, and remove before KOBJ_UNBIND, hence the order above.
"""

from __future__ import annotations

import pytest
from kernelkit import show

from gpunode.host.uevents import DEVICE_SUBSYSTEMS

pytestmark = pytest.mark.integration

# The multicast group the kernel itself sends uevents on (lib/kobject_uevent.c;
# libudev's "kernel" source; group 2 is udevd's re-broadcast, absent here).
KERNEL_UEVENT_GROUP = 1
# The plugin must notice an unbind within 1 s (test_kernel_plugin.py); the events
# are queued when the write returns, so they are heard well within that.
HEARD_WITHIN_S = 1.0


def _uevents(guest) -> dict:
    step = guest.step("uevents")
    assert step.get("opened"), f"open_kernel_events() gave None in the guest (see the console):\n{show(step)}"
    return step


def _find(events: list[dict], action: str, subsystem: str, devpath_end: str) -> int | None:
    for index, event in enumerate(events):
        if (event["action"], event["subsystem"]) == (action, subsystem) and event["devpath"].endswith(devpath_end):
            return index
    return None


def _listing(events: list[dict]) -> str:
    return "\n".join(f"  {e['action']} {e['subsystem']} {e['devpath']} driver={e['driver']}" for e in events) or "  (none)"


def test_a_bind_to_vfio_pci_is_announced_with_the_driver_and_the_new_group(guest):
    step = _uevents(guest)
    bdf, events = step["bdf"], step["bind_events"]
    assert step["driver_after_bind"] == "vfio-pci", show(step, "override", "probe", "driver_after_bind")
    bind = _find(events, "bind", "pci", "/" + bdf)
    assert bind is not None, f"no bind uevent for {bdf}; heard:\n{_listing(events)}"
    assert events[bind]["driver"] == "vfio-pci", f"the bind uevent names driver {events[bind]['driver']!r}"
    group = _find(events, "add", "vfio", f"/devices/virtual/vfio/{step['group']}")
    assert group is not None, f"no add uevent for /devices/virtual/vfio/{step['group']}; heard:\n{_listing(events)}"
    assert events[group]["devpath"] == f"/devices/virtual/vfio/{step['group']}", events[group]
    assert group < bind, f"the group was announced after the bind (probe runs before driver_bound):\n{_listing(events)}"


def test_an_unbind_is_announced_as_the_mirror(guest):
    step = _uevents(guest)
    bdf, events = step["bdf"], step["unbind_events"]
    assert step["driver_after_unbind"] is None, show(step, "unbind", "driver_after_unbind")
    unbind = _find(events, "unbind", "pci", "/" + bdf)
    assert unbind is not None, f"no unbind uevent for {bdf}; heard:\n{_listing(events)}"
    assert events[unbind]["driver"] is None, "the unbind uevent still names a driver (dev->driver is cleared first)"
    group = _find(events, "remove", "vfio", f"/devices/virtual/vfio/{step['group']}")
    assert group is not None, f"no remove uevent for the group's device; heard:\n{_listing(events)}"
    assert group < unbind, f"the group went after the unbind (remove runs before KOBJ_UNBIND):\n{_listing(events)}"


def test_the_vfio_dev_device_comes_and_goes_with_the_binding(guest):
    """6.1 gives every VFIO device a ``vfio-dev/vfioM`` device under the PCI device,
    iommufd or not (Debian's 6.1 has no iommufd: test_kernel_facts.py)."""
    step = _uevents(guest)
    bdf = step["bdf"]
    added = [e for e in step["bind_events"] if (e["action"], e["subsystem"]) == ("add", "vfio-dev")]
    removed = [e for e in step["unbind_events"] if (e["action"], e["subsystem"]) == ("remove", "vfio-dev")]
    assert len(added) == 1 and f"/{bdf}/vfio-dev/vfio" in added[0]["devpath"], _listing(step["bind_events"])
    assert [e["devpath"] for e in removed] == [added[0]["devpath"]], _listing(step["unbind_events"])


def test_the_events_are_there_when_the_write_returns(guest):
    step = _uevents(guest)
    for key in ("bind_heard_after_s", "unbind_heard_after_s"):
        assert step[key] is not None and step[key] < HEARD_WITHIN_S, (
            f"{key}: {step[key]} (expected the events on the socket within {HEARD_WITHIN_S} s of the write)")


def test_the_subsystem_filter_keeps_every_event_about_the_device(guest):
    """What ``KernelEvents.drain()`` keeps is exactly what the kernel sent for
    pci/vfio/vfio-dev: nothing lost in pyudev's translation or the filter."""
    step = _uevents(guest)
    for phase in ("bind", "unbind"):
        kept, everything = step[f"{phase}_events"], step[f"all_{phase}_events"]
        expected = [e for e in everything if e["subsystem"] in DEVICE_SUBSYSTEMS]
        assert kept == expected, f"{phase}: kept\n{_listing(kept)}\nthe kernel sent\n{_listing(everything)}"


def test_the_uevent_step_leaves_the_device_as_it_was(guest):
    """The later steps (the non-viable group) start from no driver and no override."""
    step = _uevents(guest)
    assert step["driver_after_unbind"] is None and step["override_after"] == "(null)", (
        show(step, "driver_after_unbind", "override_after", "undo_override"))


def test_the_device_plugin_listens_to_kernel_uevents(guest):
    """The running ``sandbox-device-plugin`` holds a NETLINK_KOBJECT_UEVENT socket
    subscribed to the kernel's group (/proc/net/netlink), and a ``DeviceWatcher``
    started on the real root says it hears uevents. The plugin logs nothing when
    it does (only a warning when it cannot), hence the socket check."""
    plugin, step = guest.step("plugin"), _uevents(guest)
    sockets = plugin.get("uevent_sockets")
    assert sockets is not None, f"the plugin step did not get that far:\n{plugin.get('error', '')}"
    assert any(s["groups"] & KERNEL_UEVENT_GROUP for s in sockets), (
        f"plugin PID {plugin['plugin_pid']} holds no kernel-uevent netlink socket: {sockets}\n"
        f"plugin log:\n{plugin.get('log', '')[-3000:]}")
    assert step["watcher_hears_uevents"] is True, show(step, "watcher_hears_uevents")
