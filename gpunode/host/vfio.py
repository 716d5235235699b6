"""Moving devices to vfio-pci and back, one IOMMU group at a time.

Which groups move is ``gpunode.host.vfiogroups``' decision. The procedure is the kernel's own for moving a device between drivers: ``driver_override``,
``<driver>/unbind``, ``drivers_probe``. Guarantees: a group moves whole or not
at all; a group with a foreign endpoint is never touched; a device already on
vfio-pci is left alone; a GPU in use is not unbound unless forced; the
original driver of each moved device is recorded before the first write so a
revert (or a crash followed by a revert) restores exactly it.

Every write and module load goes to the root's kernel (``host.kernel``,
``gpunode.host.kernel``), so this code runs unchanged on a real node and on one
the simulated node (``nodesim``) made.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field, replace

from gpunode.host import holders, iommu, sysfs, variants
from gpunode.host.errors import HostError
from gpunode.host.faults import write_point
from gpunode.host.files import read_json, remove_file, write_json
from gpunode.host.kernel import BlockedWrite, read_bounded
from gpunode.host.pci import VFIO_DRIVER, Device, is_vfio_driver
from gpunode.host.root import HostRoot
from gpunode.host.variants import VfioDriver
from gpunode.host.vfiogroups import GroupDecision, in_use

log = logging.getLogger(__name__)

STATE_FILE = "vfio.json"


@dataclass
class BindReport:
    changes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    # unbind_all: devices left on vfio-pci because a process (a VM) holds them, with who
    held: dict[str, list[holders.Holder]] = field(default_factory=dict)


# ---- changing the host -------------------------------------------------------


def load_vfio(host: HostRoot, driver: VfioDriver = variants.PLAIN) -> bool:
    """Make sure ``driver`` (vfio-pci or a variant driver) is loaded; True when we loaded it."""
    if host.path(f"{sysfs.PCI_DRIVERS}/{driver.name}").is_dir():
        return False
    module = VFIO_DRIVER if driver.module == variants.VFIO_PCI_MODULE else driver.module
    complaint = host.kernel.modprobe(host, module)
    if complaint is not None or not host.path(f"{sysfs.PCI_DRIVERS}/{driver.name}").is_dir():
        detail = complaint or "exit code 0"
        raise HostError(f"{driver.name} is not loaded and 'modprobe {module}' failed ({detail}); install the "
                        "kernel's vfio modules on the node")
    return True


def _state(host: HostRoot) -> dict:
    try:
        data = read_json(host.state_path(STATE_FILE), {"version": 1, "devices": {}})
    except ValueError as exc:
        raise HostError(str(exc)) from exc
    data.setdefault("devices", {})
    return data


def bound_by_us(host: HostRoot) -> dict[str, dict]:
    """Devices katamgr moved to vfio-pci, with the driver each had before."""
    return dict(_state(host)["devices"])


def _current_driver(host: HostRoot, bdf: str) -> str | None:
    return sysfs.link_name(host.path(f"{sysfs.PCI_DEVICES}/{bdf}/driver"))


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def bind(host: HostRoot, decisions: list[GroupDecision], *, wait: float = 5.0) -> BindReport:
    """Carry out the BIND decisions; each group moves whole or is rolled back."""
    report = BindReport()
    todo = [d for d in decisions if d.to_move]
    if not todo:
        return report
    needed = {decision.driver_for(d).name: decision.driver_for(d) for decision in todo for d in decision.to_move}
    for driver in sorted(needed.values(), key=lambda d: d.name != VFIO_DRIVER):
        try:
            if load_vfio(host, driver):
                report.changes.append(f"loaded the {driver.module.replace('_', '-')} module")
        except HostError as exc:
            if driver.name == VFIO_DRIVER:
                raise
            report.failures.append(str(exc))
            todo = [d for d in todo if all(d.driver_for(x).name != driver.name for x in d.to_move)]
    for decision in todo:
        try:
            moved = _bind_group(host, decision, wait)
        except HostError as exc:
            report.failures.append(str(exc))
            continue
        report.changes.extend(
            f"bound {d.bdf} ({d.id_string()}) to {decision.driver_for(d).name}, was {d.driver or 'unbound'} "
            f"[IOMMU group {decision.group}]"
            for d in moved
        )
    return report


def _bind_group(host: HostRoot, decision: GroupDecision, wait: float) -> list[Device]:
    state = _state(host)
    for device in decision.to_move:
        # Recorded before the first write: a crash mid-way stays revertible.
        # The override is read afresh: the scan reads it only for NVIDIA devices.
        path = f"{sysfs.PCI_DEVICES}/{device.bdf}/driver_override"
        override = read_bounded(host.path(path), path)
        override = override.strip() if override is not None else None
        state["devices"].setdefault(device.bdf, {
            "driver": device.driver,
            "override": _original_override(override),
            "group": decision.group,
        })
    write_json(host.state_path(STATE_FILE), state)
    moved: list[Device] = []
    try:
        for device in decision.to_move:
            moved.append(device)
            _move_to_vfio(host, device, decision.driver_for(device).name, forced=decision.forced)
        node = host.path(f"/dev/vfio/{decision.group}")
        if not _wait_for(node.exists, wait):
            raise HostError(
                f"/dev/vfio/{decision.group} did not appear within {wait:g}s after binding IOMMU group "
                f"{decision.group}; check udev and dmesg"
            )
    except BlockedWrite as exc:
        # The device whose write the kernel holds is mid-move, and will finish the
        # move by itself when released: its record stays, so a revert can return it.
        stuck = moved[-1]
        undo_errors = _roll_back(host, moved[:-1], state["devices"])
        extra = f" (roll-back problems: {'; '.join(undo_errors)})" if undo_errors else ""
        raise HostError(
            f"binding IOMMU group {decision.group} stopped: {exc}; {stuck.bdf} stays recorded as moved by "
            f"katamgr, and 'katamgr revert' returns it to {stuck.driver or 'no driver'} once that write "
            f"has completed{extra}") from exc
    except (HostError, OSError) as exc:
        # An OSError: a write that failed after the checks (a read-only remount, a full disk).
        why = exc if isinstance(exc, HostError) else f"{exc.filename or 'a write'}: {exc.strerror or exc}"
        undo_errors = _roll_back(host, moved, state["devices"])
        extra = f" (roll-back problems: {'; '.join(undo_errors)})" if undo_errors else ""
        raise HostError(f"binding IOMMU group {decision.group} failed and was rolled back: {why}{extra}") from exc
    return moved


def _kernel_write(host: HostRoot, path: str, value: str) -> None:
    write_point(f"kernel {path} <- {value.strip()!r}")
    host.kernel.write(host, path, value)


def _original_override(value: str | None) -> str | None:
    """The override to give back on revert. ``vfio-pci`` on a device not yet on vfio-pci
    is a move in flight (another tool's, or one a crash cut short), never a setting to
    restore: restoring it would send the device straight back to vfio-pci."""
    if value in (None, "", "(null)") or is_vfio_driver(value):
        return None
    return value


def _move_to_vfio(host: HostRoot, device: Device, target: str = VFIO_DRIVER, *, forced: bool = False) -> None:
    base = f"{sysfs.PCI_DEVICES}/{device.bdf}"
    _kernel_write(host, f"{base}/driver_override", target + "\n")
    current = _current_driver(host, device.bdf)
    if current is not None and current != target:
        if not forced:
            # Looked at again right before the write: the plan may be minutes old,
            # and the driver would make the writer wait for the user to let go.
            _refuse_if_held(device.bdf, in_use(host, [replace(device, driver=current)]))
        _kernel_write(host, f"{sysfs.PCI_DRIVERS}/{current}/unbind", device.bdf)
    if _current_driver(host, device.bdf) is None:
        _kernel_write(host, sysfs.DRIVERS_PROBE, device.bdf)
    # drivers_probe returns success even when vfio-pci's probe fails (the
    # reason is only in dmesg): the driver link is the one true answer.
    now = _current_driver(host, device.bdf)
    if now != target:
        raise HostError(f"{device.bdf} did not bind to {target} (driver is now {now or 'none'}); see dmesg for the probe error")


class DeviceHeld(HostError):
    """A process holds the device, so its driver cannot be taken away now."""

    def __init__(self, bdf: str, who: list[holders.Holder]):
        self.bdf = bdf
        self.holders = who
        names = "; ".join(str(h) for h in who)
        super().__init__(f"{bdf} is in use by {names}: stop it first or pass --force")


def _refuse_if_held(bdf: str, who: list[holders.Holder]) -> None:
    if who:
        raise DeviceHeld(bdf, who)


def _restore(host: HostRoot, bdf: str, driver: str | None, override: str | None, *,
             group: int | None = None, forced: bool = False) -> None:
    base = f"{sysfs.PCI_DEVICES}/{bdf}"
    current = _current_driver(host, bdf)
    if not forced and (current is None or is_vfio_driver(current)):
        # Never write unbind for a group a VM holds: vfio-pci would ask the VM to
        # give the device up and the write would wait until it does. Driverless
        # counts too: during an unbind the kernel holds, the driver link is
        # already gone while the VM still has the group (seen on Debian's 6.1).
        _refuse_if_held(bdf, vfio_holders(host, bdf, group))
    if is_vfio_driver(current):
        _kernel_write(host, f"{sysfs.PCI_DRIVERS}/{current}/unbind", bdf)
    _kernel_write(host, f"{base}/driver_override", (override or "") + "\n")
    if driver is not None and _current_driver(host, bdf) is None:
        _kernel_write(host, sysfs.DRIVERS_PROBE, bdf)
        now = _current_driver(host, bdf)
        if now != driver:
            raise HostError(f"{bdf} came back on {now or 'no driver'} instead of {driver}; bind it by hand: echo {bdf} > /sys/bus/pci/drivers/{driver}/bind")


def _roll_back(host: HostRoot, moved: list[Device], recorded: dict[str, dict]) -> list[str]:
    errors = []
    state = _state(host)
    for device in reversed(moved):
        try:
            _restore(host, device.bdf, device.driver, recorded.get(device.bdf, {}).get("override"),
                     group=device.iommu_group)
            state["devices"].pop(device.bdf, None)
        except HostError as exc:
            errors.append(str(exc))
        except OSError as exc:
            errors.append(f"{device.bdf}: {exc.filename or 'a write'}: {exc.strerror or exc}")
    try:
        write_json(host.state_path(STATE_FILE), state)
    except OSError as exc:  # the record keeps the devices: a revert still finds them
        errors.append(f"{STATE_FILE} not updated: {exc.strerror or exc}")
    return errors


def vfio_holders(host: HostRoot, bdf: str, group: int | None) -> list[holders.Holder]:
    """Processes (a QEMU of a running Kata VM) holding the device's VFIO nodes open."""
    paths = {f"/dev/vfio/{group}"} if group is not None else set()
    cdev = iommu.vfio_cdev(host, bdf)
    if cdev:
        paths.add(f"/dev/vfio/devices/{cdev}")
    return holders.holders(host, paths)


def unbind_all(host: HostRoot, *, force: bool = False, keep: Collection[str] = ()) -> BindReport:
    """Put every device katamgr moved back on the driver it had.

    A device whose VFIO node a process (a VM) holds open is left alone unless
    forced: Linux would block the unbind and ask the VM to give the GPU up.
    ``keep`` names devices to leave on vfio-pci whatever holds them (a GPU the
    kubelet gave a pod whose VM has not opened it yet); the rest of each one's
    IOMMU group stays with it, since a group moves whole.
    """
    report = BindReport()
    state = _state(host)
    kept_groups = {state["devices"][bdf].get("group") for bdf in keep if bdf in state["devices"]}
    for bdf, record in sorted(state["devices"].items()):
        if bdf in keep or (record.get("group") is not None and record.get("group") in kept_groups):
            continue
        if not host.path(f"{sysfs.PCI_DEVICES}/{bdf}").exists():
            report.changes.append(f"forgot {bdf}: the device is gone from the host")
            state["devices"].pop(bdf)
            continue
        current = _current_driver(host, bdf)
        original = record.get("driver")
        if current is not None and not is_vfio_driver(current) and current != original:
            report.failures.append(f"{bdf} is now on {current}, which katamgr did not do; left alone")
            continue
        try:
            _restore(host, bdf, original, record.get("override"), group=record.get("group"), forced=force)
        except DeviceHeld as exc:
            report.held[bdf] = exc.holders
            who = "; ".join(str(h) for h in exc.holders)
            report.failures.append(f"{bdf} is in use by {who}: stop that VM first or pass --force; left on vfio-pci")
            continue
        except HostError as exc:
            report.failures.append(str(exc))
            continue
        except OSError as exc:  # a write that failed (read-only, full): the record stays for next time
            report.failures.append(f"{bdf} was not given back to {original or 'no driver'}: "
                                   f"{exc.filename or 'a write'}: {exc.strerror or exc}; left on vfio-pci")
            continue
        state["devices"].pop(bdf)
        report.changes.append(f"restored {bdf} to {original or 'no driver'}")
    if state["devices"]:
        write_json(host.state_path(STATE_FILE), state)
    else:
        remove_file(host.state_path(STATE_FILE))
    return report


# ---- a device reset under no driver (a CC mode switch) -----------------------


def unbind_for_reset(host: HostRoot, bdf: str) -> str | None:
    """Unbind ``bdf`` from whatever driver it has, so NVIDIA's tool can stage a mode and reset
    it; returns the driver it had (for ``rebind_after_reset``). Holders are looked at again
    right before the write: a held device is never unbound here. katamgr's record of the
    device (its original driver, for revert) is left as it is."""
    current = _current_driver(host, bdf)
    if current is None:
        return None
    if is_vfio_driver(current):
        _refuse_if_held(bdf, vfio_holders(host, bdf, iommu.group_of(host, bdf)))
    else:
        _refuse_if_held(bdf, in_use(host, [_device_on(host, bdf, current)]))
    _kernel_write(host, f"{sysfs.PCI_DRIVERS}/{current}/unbind", bdf)
    return current


def rebind_after_reset(host: HostRoot, bdf: str, driver: str | None) -> None:
    """Give ``bdf`` back the driver it had before ``unbind_for_reset``: a probe (its
    driver_override, vfio-pci or its variant for a passthrough device, still names it),
    else a bind to that driver."""
    if driver is None or _current_driver(host, bdf) == driver:
        return
    if _current_driver(host, bdf) is None:
        _kernel_write(host, sysfs.DRIVERS_PROBE, bdf)
    if _current_driver(host, bdf) is None and host.path(f"{sysfs.PCI_DRIVERS}/{driver}").is_dir():
        _kernel_write(host, f"{sysfs.PCI_DRIVERS}/{driver}/bind", bdf)
    now = _current_driver(host, bdf)
    if now != driver:
        raise HostError(f"{bdf} came back on {now or 'no driver'} instead of {driver} after its reset; bind it "
                        f"by hand: echo {bdf} > /sys/bus/pci/drivers/{driver}/bind")


def _device_on(host: HostRoot, bdf: str, driver: str) -> Device:
    from gpunode.host.pci import read_device

    return replace(read_device(host, bdf), driver=driver)
