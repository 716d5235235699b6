"""Switching the node's GPUs to a confidential-computing mode, as NVIDIA's k8s-cc-manager does.

The procedure (k8s-cc-manager ``main.py``, ``_set_cc_mode_direct``/``_set_ppcie_mode_direct``;
its earlier script unbound the GPUs from their drivers first, ``_unbind_device``):

1. the devices it touches: for ``on``, ``off``, ``devtools`` every CC-capable GPU, and every
   device still in PPCIe mode (which the switch turns off); for ``ppcie`` every NVIDIA GPU
   and NVSwitch, each of which must have a PPCIe mode (Hopper HGX). A CC mode other than
   ``off`` is refused when some GPU of the node is not CC-capable: half a node in CC mode
   serves no confidential VM;
2. nothing held: a GPU a VM holds open (its ``/dev/vfio`` node), one the kubelet gave a pod,
   or one a driver other than VFIO runs (NVIDIA's tool maps the GPU's registers and writes
   some: never under a running driver) keeps the switch waiting, never forced;
3. each device unbound from its driver (the tool resets the device under no driver),
   remembering which; the new mode staged on each; all of them reset in one batch; each
   read back;
4. each device bound back to the driver it had (vfio-pci or its variant driver, for
   passthrough), whether or not the switch worked.

The mode read back is the node's ``cc.mode.state``; any device that did not come back in the
wanted mode, or a tool failure, makes it ``failed``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpunode.host import cc, vfio
from gpunode.host.cc import CcMode, Reading
from gpunode.host.errors import HostError
from gpunode.host.pci import Device
from gpunode.host.root import HostRoot
from gpunode.policy.inventory import discover
from gpunode.policy.naming import Naming
from gpunode.services.lock import node_lock
from gpunode.services.podresources import PodDevices, assigned_functions, list_pod_devices
from katamgr.pipeline.report import Report

DEFAULT_LOCK_WAIT = 60.0


@dataclass
class CcSwitchReport(Report):
    """What a switch did: the sentences, and the node's mode state afterwards."""

    wanted: str = ""
    state: str = ""  # the mode read back from every device, "failed", or "" (waiting)
    switched: list[str] = field(default_factory=list)  # BDFs reset into the new mode
    held: dict[str, str] = field(default_factory=dict)  # BDF -> who holds it (the switch waits)
    # Devices not read because a VM, pod or process holds them, when every device read runs the
    # wanted mode: the node is as wanted unless one of these is not (a reset, which needs no
    # holder, is the only way a mode changes), so the caller goes by what it published last.
    unverified: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def waiting(self) -> bool:
        return bool(self.held)


@dataclass(frozen=True)
class NodeCc:
    """The node's CC facts now (read-only): which devices a switch to ``wanted`` touches,
    their modes, and what is wrong."""

    wanted: CcMode
    devices: tuple[Device, ...]
    readings: dict[str, Reading]
    problems: tuple[str, ...]
    unread: dict[str, str] = field(default_factory=dict)  # BDF -> who holds it (not read)

    @property
    def differ(self) -> list[Device]:
        return [d for d in self.devices
                if d.bdf not in self.unread and not _in_mode(self.readings.get(d.bdf), self.wanted)]

    @property
    def state(self) -> str:
        """The node's mode as read: the wanted mode when every device runs it, the single
        mode they all run otherwise, else ``failed`` (mixed)."""
        if self.problems:
            return cc.FAILED
        if not self.devices:
            return CcMode.OFF.value
        modes = {self.readings[d.bdf].node_mode for d in self.devices if d.is_gpu and d.bdf in self.readings}
        if not self.differ:
            return self.wanted.value
        return modes.pop() if len(modes) == 1 and None not in modes else cc.FAILED


def _in_mode(reading: Reading | None, wanted: CcMode) -> bool:
    if reading is None:
        return False
    if wanted is CcMode.PPCIE:
        return reading.ppcie == "on"
    if reading.ppcie == "on":
        return False
    return reading.cc is None or reading.cc == wanted.value


def look(host: HostRoot, naming: Naming, wanted: CcMode, held: dict[str, str] | None = None) -> NodeCc:
    """Which devices a switch to ``wanted`` touches and what they run now (reads each with
    NVIDIA's tool, but none in ``held``: the tool maps a device's BAR and writes to it, which is
    never done to a GPU a VM runs on)."""
    held = held or {}
    inv = discover(host, naming.selection, naming.nvswitch_rule)
    gpus = inv.gpus
    admin = host.kernel.gpu_admin()
    problems: list[str] = []
    capable = [g for g in gpus if cc.cc_capable(g)]
    if wanted is not CcMode.OFF and capable and len(capable) != len(gpus):
        models = sorted({f"{naming.model(g) or g.id_string()} ({g.bdf})" for g in gpus if g not in capable})
        problems.append(f"CC mode {wanted} needs every GPU of the node CC-capable, and {', '.join(models)} "
                        "is not (NVIDIA's gpu-admin-tools: Hopper and later only)")
    candidates = capable + [s for s in inv.nvswitches]
    readings: dict[str, Reading] = {}
    for device in candidates:
        if device.bdf in held:
            continue
        try:
            readings[device.bdf] = admin.query(host, device.bdf)
        except HostError as exc:
            problems.append(str(exc))
    if wanted is CcMode.PPCIE:
        devices = [d for d in (gpus + inv.nvswitches)]
        lacking = [d.bdf for d in devices if d.bdf in readings and readings[d.bdf].ppcie is None]
        lacking += [d.bdf for d in gpus if d not in capable]
        if lacking:
            problems.append(f"PPCIe mode needs every GPU and NVSwitch of the node to have one, and "
                            f"{', '.join(sorted(set(lacking)))} has none (Hopper HGX systems only)")
    else:
        devices = capable + [s for s in inv.nvswitches
                             if s.bdf in held or readings.get(s.bdf, Reading(None, None)).ppcie == "on"]
    unread = {d.bdf: held[d.bdf] for d in devices if d.bdf in held}
    return NodeCc(wanted, tuple(sorted(devices, key=lambda d: d.bdf)), readings, tuple(problems), unread)


def candidates(host: HostRoot, naming: Naming) -> list[Device]:
    """Every device a switch may touch: the CC-capable GPUs and the NVSwitches."""
    inv = discover(host, naming.selection, naming.nvswitch_rule)
    return [g for g in inv.gpus if cc.cc_capable(g)] + list(inv.nvswitches)


def holders_of(host: HostRoot, naming: Naming, devices: list[Device],
               pod_devices: Callable[[], PodDevices] | None = None) -> dict[str, str]:
    """Who holds each of ``devices``: a VM (its /dev/vfio node), a pod, or a driver other than VFIO."""
    held: dict[str, str] = {}
    for device in devices:
        if device.driver is not None and not device.on_vfio:
            # The tool maps the device's registers and writes some: never under a running
            # driver (a node that opts out of vfio-manager keeps its GPUs on nvidia).
            held[device.bdf] = f"{device.driver} (katamgr reads and switches GPUs on VFIO or no driver only)"
            continue
        who = vfio.vfio_holders(host, device.bdf, device.iommu_group) if device.on_vfio else []
        if who:
            held[device.bdf] = "; ".join(str(h) for h in who)
    asked = (pod_devices or (lambda: list_pod_devices(host)))()
    if asked.assignments:
        inv = discover(host, naming.selection, naming.nvswitch_rule)
        given = assigned_functions(host, inv, naming, asked.assignments)
        for device in devices:
            if given.get(device.bdf):
                pods = ", ".join(str(a) for a in given[device.bdf])
                held[device.bdf] = f"{held[device.bdf]}; {pods}" if device.bdf in held else pods
    return held


def switch(host: HostRoot, naming: Naming, wanted: CcMode, *, lock_wait: float = DEFAULT_LOCK_WAIT,
           command: str = "katamgr run (CC mode)",
           pod_devices: Callable[[], PodDevices] | None = None,
           before: Callable[[], None] | None = None) -> CcSwitchReport:
    """Carry the node to ``wanted`` (the module's procedure), holding the node lock;
    ``before`` is called once it is decided that devices will be reset, before the first."""
    started = time.monotonic()
    with node_lock(host, command, lock_wait):
        report = _switch(host, naming, wanted, pod_devices, before)
    report.seconds = time.monotonic() - started
    return report


def _switch(host: HostRoot, naming: Naming, wanted: CcMode,
            pod_devices: Callable[[], PodDevices] | None,
            before: Callable[[], None] | None = None) -> CcSwitchReport:
    report = CcSwitchReport(wanted=wanted.value)
    held = holders_of(host, naming, candidates(host, naming), pod_devices)
    node = look(host, naming, wanted, held)
    if node.problems:
        report.failures += list(node.problems)
        report.state = cc.FAILED
        return report
    todo = node.differ
    if not todo:
        if node.unread:
            report.unverified = dict(node.unread)
        else:
            report.state = node.state
        return report
    report.held = {bdf: who for bdf, who in held.items() if bdf in {d.bdf for d in node.devices}}
    if report.held:
        report.warnings.append(
            f"switching to CC mode {wanted} waits: " + "; ".join(f"{b} is held by {w}" for b, w in sorted(report.held.items()))
            + " (never forced: the switch resets the GPU)")
        return report
    if before is not None:
        before()
    drivers: dict[str, str | None] = {}
    try:
        for device in todo:
            drivers[device.bdf] = vfio.unbind_for_reset(host, device.bdf)
        staged: list[Device] = []
        admin = host.kernel.gpu_admin()
        try:
            for device in todo:
                admin.stage(host, device.bdf, wanted)
                staged.append(device)
        except HostError as exc:
            report.failures.append(str(exc))
            _unstage(host, staged, node.readings, report)
            report.state = cc.FAILED
            return report
        admin.reset(host, [d.bdf for d in todo])
        report.switched = [d.bdf for d in todo]
        for device in todo:
            reading = admin.query(host, device.bdf)
            node.readings[device.bdf] = reading
            if _in_mode(reading, wanted):
                report.changes.append(f"{device.bdf} ({naming.model(device) or device.id_string()}) now runs "
                                      f"CC mode {reading.node_mode} (read back after the reset)")
            else:
                report.failures.append(f"{device.bdf} was reset into CC mode {wanted} but reads back "
                                       f"{reading.node_mode}")
    except HostError as exc:
        report.failures.append(str(exc))
    finally:
        for bdf, driver in drivers.items():
            try:
                vfio.rebind_after_reset(host, bdf, driver)
            except HostError as exc:
                report.failures.append(str(exc))
    report.state = cc.FAILED if report.failures else wanted.value
    return report


def _unstage(host: HostRoot, staged: list[Device], readings: dict[str, Reading], report: CcSwitchReport) -> None:
    """Stage the modes the devices still run on those already staged, so the next reset
    (a reboot) does not bring half a switch in."""
    admin = host.kernel.gpu_admin()
    for device in staged:
        reading = readings.get(device.bdf)
        mode = reading.node_mode if reading is not None else None
        if mode is None:
            continue
        try:
            admin.stage(host, device.bdf, CcMode(mode))
        except (HostError, ValueError) as exc:
            report.failures.append(f"{device.bdf} keeps a staged CC mode that takes effect at its next reset: {exc}")
