"""A passthrough unit's health beyond its binding: what the host kernel sees of its devices.

The rule is the node's health policy (``gpunode.policy.health``, which the agent's hand-back
check and its metrics read too): a unit is Unhealthy while one of its devices is gone, off
the bus, has a PCIe link that is down or (link policy ``degrade``) trained below its
maximum, has no reset method the kernel can use, failed its hand-back check between tenants
(the agent's verdict file, ``gpunode.host.handback``), is being recovered by the kernel, or
reported fatal or non-fatal AER errors since its counts were last accepted (a ``Trip``, until
the kernel or a hand-back says it recovered). Correctable errors are only counted.

What is here is the I/O around it: the per-device state, the kernel's recovery uevents
mapped onto the devices they concern (``heard``), Allocate's cheap re-read (``recheck``), and
the poll. A device enumerated again (remove and rescan, a hot-plug) is seen by its sysfs
directory being another one, or by counts below the baseline, and starts a new ``Trip``.

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
from gpunode.host.root import HostRoot
from gpunode.host.uevents import UEvent
from gpunode.policy.health import BEGUN, DEFAULT_LINK_POLICY, FAILED, RECOVERED, HealthPolicy, Trip

log = logging.getLogger(__name__)

HEALTH_INTERVAL = 0.5  # seconds between polls of the listed units' facts
# What Allocate reads again of each device it hands out, raw (a few bytes each): what a fault
# since the last poll changes. While they read as at the last judgement, its verdict stands;
# otherwise the device is judged in full. The directory's inode and the config space are
# read too (``_fingerprint``).
_WATCHED = ("aer_dev_fatal", "aer_dev_nonfatal", "current_link_width", "current_link_speed", "reset_method")


@dataclass
class _Device:
    trip: Trip
    verdict: str = ""  # the last reason given ("" healthy)
    seen: tuple | None = None  # ``_fingerprint`` as the last judgement read it
    code: str = ""  # its code (one of gpunode.policy.health.REASONS)


class DeviceHealth:
    """Per device: the AER baseline, a trip until recovery, the last verdict."""

    def __init__(self, host: HostRoot, *, link_policy: str = DEFAULT_LINK_POLICY,
                 on_transition: Callable[[str, str, str], None] | None = None) -> None:
        self.host = host
        self.policy = HealthPolicy(link_policy)  # a ValueError naming the bad value and the choices
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
                if bdf == name or (event.error_event == FAILED and f"/{name}/" in self._sysfs_path(bdf)):
                    device.trip.heard(event.error_event, now)
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
    def _another_directory(device: _Device, seen: tuple) -> bool:
        """The device directory is another one than the last judgement read (a new kernfs node)."""
        return device.seen is not None and seen[-2] is not None and device.seen[-2] is not None \
            and seen[-2][:2] != device.seen[-2][:2]

    def _verdict_path(self, bdf: str) -> str:
        path = self._verdicts[bdf] = str(self.host.path(f"{handback.VERDICTS}/{bdf}.json"))
        return path

    def _judge(self, bdf: str, peek: bool) -> str:
        seen = self._fingerprint(bdf)  # read first: a change after it is seen at the next look
        facts = pcihealth.read_health(self.host, bdf)
        verdict = handback.read_verdict(self.host, bdf)
        now = time.time()
        with self._lock:
            device = self._devices.get(bdf)
            if device is None:
                device = _Device(Trip.first(facts, verdict, now))
                if not peek:
                    self._devices[bdf] = device
            elif self._another_directory(device, seen) or device.trip.counts_fell(facts.aer):
                fresh = _Device(Trip.re_enumerated(now), verdict=device.verdict, code=device.code)
                if not peek:
                    log.info("%s was enumerated again: its AER counts start at zero", bdf)
                    self._devices[bdf] = fresh
                device = fresh
            trip = device.trip if not peek else device.trip.copy()
            code, reason = trip.judge(self.policy, facts, verdict, now, peek=peek)
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
