"""A passthrough unit's health beyond its binding: what the host kernel sees of its devices.

The rule is ``gpunode.host.pcihealth.problems`` (the agent judges by the same one): a unit
is Unhealthy while one of its devices is off the bus (config space reads 0xffff), has a PCIe
link that is down or (``--link-policy degrade``) trained below its maximum, has no reset
method the kernel can use, failed its hand-back check between tenants (the agent's verdict,
``gpunode.host.handback``), or reported fatal or non-fatal AER errors since its counts were
last accepted. Correctable errors are only counted (the agent alerts on their rate).

The kernel's error recovery is followed too (``heard``): between its BEGIN_RECOVERY and its
SUCCESSFUL_RECOVERY on a device, the device is Unhealthy, and for good (until a hand-back
reads it back sane) after a FAILED_RECOVERY on it or a port above it.

AER counts never go down while the device stays enumerated, so an AER trip ends only when
the device is known sane again: the kernel said it recovered (its ``ERROR_EVENT=SUCCESSFUL_RECOVERY`` uevent on the device,
sent by drivers/pci/pcie/err.c once every driver below the port resumed, after the port's
reset for a fatal error), or the agent's hand-back check reset it and read it back sane.
Either is honoured only once the trip was published (the kubelet saw Unhealthy), and only
while nothing else is wrong; then the counts of that moment are the new baseline. A device
enumerated again (remove and rescan, a hot-plug) has its counts allocated afresh at zero: seen
by its sysfs directory being another one, or by counts below the baseline, it starts again
from a baseline of zero.

Nothing here is pushed by the kernel except AER recoveries, so ``HealthPoller`` reads the
listed units' facts every ``interval`` seconds (a few small sysfs reads per device) and
asks for a rescan when a verdict would change: that is how an off-the-bus device or a
retrained link turns Unhealthy within a second.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpunode.host import handback, pcihealth
from gpunode.host.pcihealth import AerCounts
from gpunode.host.root import HostRoot
from gpunode.host.uevents import UEvent

log = logging.getLogger(__name__)

HEALTH_INTERVAL = 0.5  # seconds between polls of the listed units' facts
BEGUN, RECOVERED, FAILED = "BEGIN_RECOVERY", "SUCCESSFUL_RECOVERY", "FAILED_RECOVERY"
HAND_BACK_FAILED = "HandBackFailed"
RECOVERING = "AerRecovery"  # the kernel began recovering the device, and has not said it did  # include/linux/pci.h, pci_uevent_ers
_AER = (pcihealth.AER_FATAL, pcihealth.AER_NONFATAL)
# What Allocate reads again of each device it hands out, raw (a few bytes each): what a fault
# since the last poll changes. While they read as at the last judgement, its verdict stands;
# otherwise the device is judged in full. The directory's inode and the config space are
# read too (``_fingerprint``).
_WATCHED = ("aer_dev_fatal", "aer_dev_nonfatal", "current_link_width", "current_link_speed", "reset_method")


@dataclass
class _Device:
    baseline: AerCounts | None = None
    accepted_at: float = 0.0  # when the baseline was accepted (wall times throughout: a
    tripped_at: float = 0.0  # verdict file's time is one); an AER problem published; 0: none
    recovered_at: float = 0.0  # the last SUCCESSFUL_RECOVERY the kernel announced for it
    begun_at: float = 0.0  # the last BEGIN_RECOVERY
    failed: bool = False  # a FAILED_RECOVERY on it or a bridge above it since then
    verdict: str = ""  # the last reason given ("" healthy)
    seen: tuple | None = None  # ``_fingerprint`` as the last judgement read it
    code: str = ""  # its code (gpunode.host.pcihealth's reasons, or HAND_BACK_FAILED)


class DeviceHealth:
    """Per device: the AER baseline, a trip until recovery, the last verdict."""

    def __init__(self, host: HostRoot, *, link_policy: str = "degrade",
                 on_transition: Callable[[str, str, str], None] | None = None) -> None:
        if link_policy not in pcihealth.LINK_POLICIES:
            raise ValueError(f"link policy {link_policy!r} is not one of {', '.join(pcihealth.LINK_POLICIES)}")
        self.host = host
        self.link_policy = link_policy
        self.on_transition = on_transition  # (bdf, code, message), "" when healthy, on every change
        self._lock = threading.Lock()
        self._devices: dict[str, _Device] = {}
        self._bases: dict[str, str] = {}  # bdf -> its sysfs directory, as this process reaches it
        self._verdicts: dict[str, str] = {}  # bdf -> its hand-back verdict file, likewise

    def heard(self, event: UEvent) -> bool:
        """A kernel uevent; True when it was about the error recovery of a device we follow.

        drivers/pci/pcie/err.c sends BEGIN_RECOVERY to every device below the port that
        reported (vfio-pci answers that it can recover), SUCCESSFUL_RECOVERY to each once
        they resumed, and FAILED_RECOVERY to the port alone when recovery failed; on a 6.1
        kernel a fatal error of an endpoint is not counted in its own ``aer_dev_fatal``
        (the kernel does not read a device whose link may be down: tests/kernel saw
        "type=Inaccessible"), so these events are what says a fatal error happened."""
        if event.error_event not in (BEGUN, RECOVERED, FAILED):
            return False
        name = event.devpath.rsplit("/", 1)[-1]
        now = time.time()
        hit = []
        with self._lock:
            for bdf, device in self._devices.items():
                if bdf == name:
                    if event.error_event == BEGUN:
                        device.begun_at, device.failed = now, False
                    elif event.error_event == RECOVERED:
                        device.recovered_at = now
                    else:
                        device.failed = True
                    hit.append(bdf)
                elif event.error_event == FAILED and f"/{name}/" in self._sysfs_path(bdf):
                    device.failed = True
                    hit.append(bdf)
        for bdf in hit:
            log.info("the kernel says %s: %s", bdf, event.error_event)
        return bool(hit)

    def _sysfs_path(self, bdf: str) -> str:
        return os.path.realpath(self.host.path(f"/sys/bus/pci/devices/{bdf}"))

    def reason(self, bdfs: Iterable[str], *, peek: bool = False) -> str:
        """Why the unit of ``bdfs`` is unfit for a VM now, or "" (``peek``: change nothing)."""
        reasons = [r for r in (self._judge(bdf, peek) for bdf in bdfs) if r]
        return "; ".join(reasons)

    def recheck(self, bdfs: Iterable[str]) -> str:
        """Allocate's look, changing nothing: why the unit of ``bdfs`` is unfit now, or "".
        A device whose watched files read as at the last judgement keeps that verdict (a
        few small reads); one that changed is judged in full."""
        reasons = []
        for bdf in bdfs:
            with self._lock:
                device = self._devices.get(bdf)
                seen, verdict = (device.seen, device.verdict) if device is not None else (None, "")
            reason = verdict if seen is not None and self._fingerprint(bdf) == seen else self._judge(bdf, True)
            if reason:
                reasons.append(reason)
        return "; ".join(reasons)

    def _fingerprint(self, bdf: str) -> tuple:
        """The watched files' bytes, the vendor ID config space reads now, the device
        directory's identity and the hand-back verdict file's; None for what cannot be read."""
        base = self._bases.get(bdf)
        if base is None:
            base = self._bases[bdf] = str(self.host.path(f"/sys/bus/pci/devices/{bdf}"))
        out: list = []
        for name in (*_WATCHED, "config"):
            try:
                fd = os.open(f"{base}/{name}", os.O_RDONLY)
            except OSError:
                out.append(None)
                continue
            try:
                out.append(os.pread(fd, 2 if name == "config" else 4096, 0))
            except OSError:
                out.append(None)
            finally:
                os.close(fd)
        for path in (base, self._verdicts.get(bdf) or self._verdict_path(bdf)):
            try:
                st = os.stat(path)
                out.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                out.append(None)
        return tuple(out)

    @staticmethod
    def _re_enumerated(device: _Device, seen: tuple, aer: AerCounts | None) -> bool:
        """The device directory is another one than the last judgement read (a new kernfs
        node), or its AER counts are below the baseline (they never go down while it stays)."""
        if device.seen is not None and seen[-2] is not None and device.seen[-2] is not None \
                and seen[-2][:2] != device.seen[-2][:2]:
            return True
        base = device.baseline
        return aer is not None and base is not None and (
            aer.fatal < base.fatal or aer.nonfatal < base.nonfatal or aer.correctable < base.correctable)

    def _verdict_path(self, bdf: str) -> str:
        path = self._verdicts[bdf] = str(self.host.path(f"{handback.VERDICTS}/{bdf}.json"))
        return path

    def _judge(self, bdf: str, peek: bool) -> str:
        seen = self._fingerprint(bdf)  # read first: a change after it is seen at the next look
        facts = pcihealth.read_health(self.host, bdf)
        verdict = handback.read_verdict(self.host, bdf)
        with self._lock:
            device = self._devices.get(bdf)
            if device is None:
                # A plugin (re)started: the counts the last good hand-back saw, else today's.
                device = _Device(baseline=(verdict.aer if verdict and verdict.ok else None) or facts.aer,
                                 accepted_at=time.time())
                if not peek:
                    self._devices[bdf] = device
            elif self._re_enumerated(device, seen, facts.aer):
                # Another device, or the same one found again (remove and rescan, hot-plug): the
                # kernel allocated its AER counts afresh, at zero (``pci_aer_init``), so every
                # error it counts is new; what the one before reported, and its trip, are gone.
                fresh = _Device(baseline=pcihealth.AerCounts(), accepted_at=time.time(),
                                verdict=device.verdict, code=device.code)
                if not peek:
                    log.info("%s was enumerated again: its AER counts start at zero", bdf)
                    self._devices[bdf] = fresh
                device = fresh
            found = pcihealth.problems(facts, device.baseline, link_policy=self.link_policy)
            other = next((p for p in found if p.fatal and p.reason not in _AER), None)
            aer = next((p for p in found if p.reason in _AER), None)
            reason, code = (other.message, other.reason) if other else ("", "")
            if verdict is not None and not verdict.ok and not reason:
                reason, code = f"{bdf} failed its hand-back check: {verdict.reason}", HAND_BACK_FAILED
            ok_at = verdict.checked if verdict is not None and verdict.ok else 0.0
            if not reason and device.begun_at > max(device.recovered_at, ok_at):
                reason, code = (f"the kernel could not recover {bdf} from a PCIe error (FAILED_RECOVERY)"
                                if device.failed else f"the kernel is recovering {bdf} from a PCIe error"), RECOVERING
            elif aer is not None and not reason:
                recovered = device.tripped_at and (
                    device.recovered_at > device.accepted_at
                    or (verdict is not None and verdict.ok and verdict.checked > device.tripped_at))
                if recovered:
                    if not peek:
                        device.baseline, device.accepted_at, device.tripped_at = facts.aer, time.time(), 0.0
                else:
                    reason, code = aer.message, aer.reason
                    if not peek and not device.tripped_at:
                        device.tripped_at = time.time()
            if not peek:
                device.seen = seen
            if not peek and reason != device.verdict:
                device.verdict = reason
                if code != device.code and self.on_transition is not None:
                    self.on_transition(bdf, code, reason)
                device.code = code
            return reason


class HealthPoller:
    """Reads the listed units' facts every ``interval`` s; calls ``on_change()`` when a
    unit's verdict would differ from the one published."""

    def __init__(self, health: DeviceHealth, listed: Callable[[], dict[str, tuple[tuple[str, ...], str]]],
                 on_change: Callable[[], None], interval: float = HEALTH_INTERVAL) -> None:
        self.health = health
        self.listed = listed  # unit id -> (its BDFs, the reason published)
        self.on_change = on_change
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="health-poller", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if self.differs():
                    self.on_change()
            except Exception:  # a bad read must not end the polling
                log.exception("the health poll failed; polling on")

    def differs(self) -> bool:
        for bdfs, published in self.listed().values():
            if self.health.reason(bdfs, peek=True) != published:
                return True
        return False
