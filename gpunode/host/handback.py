"""The hand-back check between tenants, and its verdict that the device plugin reads.

When the kubelet stops listing a passthrough GPU for any pod, its VM has let go (or is
letting go) of it. vfio-pci resets a device when its last user closes it, if the kernel has a
reset method for it (drivers/vfio/pci/vfio_pci_core.c, ``vfio_pci_core_disable``); whether
that happened is not recorded anywhere we can read, so the check resets the device itself
through sysfs ``reset`` (``pci_reset_function``, the same methods) once no process holds its
VFIO nodes, then reads it back: present, config space answering (vendor not 0xffff), link
trained at its maximum, no new fatal AER error since just before the reset
(``gpunode.host.pcihealth``). A GPU that fails stays out (the device plugin lists it
Unhealthy, the DRA driver leaves it out of the slice) with the reason, until a later check
passes.

The verdict is a small JSON file per device under ``VERDICTS`` (the agent's state dir, which
the chart mounts read-only into the device plugin's and the DRA driver's containers), written
atomically by the agent and read by both plugins on every health judgement. It names the boot it
was written in: a reboot resets every device, so a verdict of an earlier boot is ignored.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from gpunode.host import files, pcihealth, sysfs, vfio
from gpunode.host.errors import HostError
from gpunode.host.pcihealth import AerCounts
from gpunode.host.root import HostRoot

VERDICTS = "/var/lib/kata-sandbox-manager/handback"
# The kernel's id of this boot: the same in every container of the host. A reboot resets every
# device, so a verdict from another boot is no verdict.
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class Verdict:
    bdf: str
    ok: bool
    reason: str  # why it failed; "" when it passed
    checked: float  # wall time of the check
    aer: AerCounts | None  # the counts read back (the plugin's new baseline when ok)
    reset: str = ""  # "sysfs reset", or why no reset was done
    seconds: float = 0.0  # how long the check took


def _path(host: HostRoot, bdf: str):
    return host.path(f"{VERDICTS}/{bdf}.json")


def read_verdict(host: HostRoot, bdf: str) -> Verdict | None:
    """The last verdict for ``bdf``, or None (none yet, or unreadable: no verdict)."""
    try:
        raw = json.loads(_path(host, bdf).read_text())
        if raw.get("boot") != _boot_id():
            return None
        aer = raw.get("aer")
        return Verdict(bdf, bool(raw["ok"]), str(raw.get("reason", "")), float(raw["checked"]),
                       AerCounts(**aer) if isinstance(aer, dict) else None, str(raw.get("reset", "")),
                       float(raw.get("seconds", 0.0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_verdict(host: HostRoot, verdict: Verdict) -> None:
    aer = verdict.aer
    body = {"boot": _boot_id(), "ok": verdict.ok, "reason": verdict.reason, "checked": verdict.checked, "reset": verdict.reset,
            "seconds": round(verdict.seconds, 4),
            "aer": None if aer is None else {"correctable": aer.correctable, "nonfatal": aer.nonfatal,
                                              "fatal": aer.fatal}}
    files.write_atomic(_path(host, verdict.bdf), json.dumps(body, sort_keys=True) + "\n")


def _boot_id() -> str | None:
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return None


def clear_verdict(host: HostRoot, bdf: str) -> None:
    _path(host, bdf).unlink(missing_ok=True)


def check(host: HostRoot, bdf: str, group: int | None, *, link_policy: str = "degrade") -> Verdict | None:
    """Reset ``bdf`` and read it back; None while a process still holds its VFIO nodes
    (its VM is still letting go: look again at the next check)."""
    started = time.monotonic()
    if vfio.vfio_holders(host, bdf, group):
        return None
    before = pcihealth.read_health(host, bdf)

    def verdict(ok: bool, reason: str, reset: str, aer: AerCounts | None) -> Verdict:
        return Verdict(bdf, ok, reason, time.time(), aer, reset, time.monotonic() - started)

    if not before.present:
        return verdict(False, "it is gone from the host", "none: gone", None)
    if not before.resettable:
        return verdict(False, "the kernel has no reset method for it, so the last tenant's state stays",
                       "none: no reset method", before.aer)
    try:
        host.kernel.write(host, f"{sysfs.PCI_DEVICES}/{bdf}/reset", "1")
    except HostError as exc:
        return verdict(False, f"its reset failed ({exc})", "sysfs reset failed", before.aer)
    after = pcihealth.read_health(host, bdf)
    found = pcihealth.problems(after, before.aer, link_policy=link_policy)
    bad = [p for p in found if p.fatal and p.reason != pcihealth.AER_NONFATAL]
    if bad:
        return verdict(False, f"after its reset: {bad[0].message}", "sysfs reset", after.aer)
    return verdict(True, "", "sysfs reset", after.aer)
