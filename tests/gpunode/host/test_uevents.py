"""The device watcher hears the real kernel's uevents, and only those it asks for.

Fact (Documentation/ABI/testing/sysfs-uevent): writing an action to a device's
``uevent`` file makes the kernel emit a synthetic uevent for it. ``change`` on
/dev/null's device is harmless (it changes no state), and lets the real netlink
socket be driven here without a PCI device to bind. The bind/unbind events of
real PCI devices are checked by tests/kernel in a guest.
"""

from __future__ import annotations

import threading
import time

import pytest

from gpunode.host.root import HostRoot
from gpunode.host.uevents import open_kernel_events
from sandbox_plugin.watch import DeviceWatcher

NULL_UEVENT = "/sys/devices/virtual/mem/null/uevent"


def _synthetic_change() -> None:
    try:
        with open(NULL_UEVENT, "w") as f:
            f.write("change")
    except OSError as exc:
        pytest.skip(f"cannot write {NULL_UEVENT} here ({exc.strerror}): needs root and a writable sysfs")


def _counting(host: HostRoot, **kw) -> tuple[DeviceWatcher, threading.Event]:
    changed = threading.Event()
    watcher = DeviceWatcher(host, changed.set, rescan_interval=60, uevents=True, **kw)
    watcher.start()
    if not watcher.hears_uevents:
        watcher.stop()
        pytest.skip("the kernel's uevent socket cannot be opened here")
    return watcher, changed


@pytest.mark.integration
def test_a_uevent_of_a_watched_subsystem_wakes_the_watcher_at_once(tmp_path):
    host = HostRoot.at(tmp_path)
    watcher, changed = _counting(host, uevent_subsystems=frozenset({"mem"}))
    try:
        started = time.monotonic()
        _synthetic_change()
        assert changed.wait(5), "no rescan after a uevent of a watched subsystem"
        assert time.monotonic() - started < 1.0
        assert watcher.rescan_interval >= 300  # uevents make the periodic rescan a safety net
    finally:
        watcher.stop()


@pytest.mark.integration
def test_uevents_of_other_subsystems_do_not_cause_a_rescan(tmp_path):
    host = HostRoot.at(tmp_path)
    watcher, changed = _counting(host)  # pci, vfio, vfio-dev
    witness = open_kernel_events(frozenset({"mem"}))  # proves the event was sent
    try:
        _synthetic_change()
        assert not changed.wait(1.0)
        assert watcher.rescans == 0
        assert witness is not None and [e.subsystem for e in witness.drain()][:1] == ["mem"]
    finally:
        watcher.stop()
        if witness is not None:
            witness.close()


@pytest.mark.integration
def test_kernel_events_carry_action_subsystem_and_path():
    events = open_kernel_events(frozenset({"mem"}))
    if events is None:
        pytest.skip("the kernel's uevent socket cannot be opened here")
    try:
        _synthetic_change()
        deadline = time.monotonic() + 5
        seen = []
        while not seen and time.monotonic() < deadline:
            seen = events.drain()
            time.sleep(0.02)
        assert [(e.action, e.subsystem, e.devpath) for e in seen][:1] == [
            ("change", "mem", "/devices/virtual/mem/null")]
    finally:
        events.close()
