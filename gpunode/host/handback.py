"""The hand-back check's mechanics between tenants, and its verdict that the plugins read.

When the kubelet stops listing a passthrough GPU for any pod, its VM has let go (or is
letting go) of it. vfio-pci resets a device when its last user closes it, if the kernel has a
reset method for it (drivers/vfio/pci/vfio_pci_core.c, ``vfio_pci_core_disable``); whether
that happened is not recorded anywhere we can read, so the check resets the device itself
through sysfs ``reset`` (``reset`` here: ``pci_reset_function``, the same methods) once no
process holds its VFIO nodes, then reads it back. What the read-back must show (present,
config space answering, the link as the node's link policy wants it, no new fatal AER error
since just before the reset) is the health policy's (``gpunode.policy.health``,
``HealthPolicy.hand_back``), the same rule the plugins judge by. A GPU that fails stays out
(the device plugin lists it Unhealthy, the DRA driver leaves it out of the slice) with the
reason, until a later check passes.

The verdict is a small JSON file per device under ``VERDICTS`` (the agent's state dir, which
the chart mounts read-only into the device plugin's and the DRA driver's containers), written
atomically by the agent and read by both plugins on every health judgement. It names the boot it
was written in: a reboot resets every device, so a verdict of an earlier boot is ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gpunode.host import files, sysfs
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
    code: str = ""  # the reason code of what failed it (gpunode.policy.health.REASONS); "" when it passed


def _path(host: HostRoot, bdf: str):
    return host.path(f"{VERDICTS}/{bdf}.json")


def read_verdict(host: HostRoot, bdf: str) -> Verdict | None:
    """The last verdict for ``bdf``, or None (none yet, or unreadable: no verdict)."""
    try:
        raw = json.loads(_path(host, bdf).read_text())
        if raw.get("boot") != boot_id():
            return None
        aer = raw.get("aer")
        return Verdict(bdf, bool(raw["ok"]), str(raw.get("reason", "")), float(raw["checked"]),
                       AerCounts(**aer) if isinstance(aer, dict) else None, str(raw.get("reset", "")),
                       float(raw.get("seconds", 0.0)), str(raw.get("code", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_verdict(host: HostRoot, verdict: Verdict) -> None:
    aer = verdict.aer
    body = {"boot": boot_id(), "ok": verdict.ok, "reason": verdict.reason, "checked": verdict.checked, "reset": verdict.reset,
            "code": verdict.code, "seconds": round(verdict.seconds, 4),
            "aer": None if aer is None else {"correctable": aer.correctable, "nonfatal": aer.nonfatal,
                                              "fatal": aer.fatal}}
    files.write_atomic(_path(host, verdict.bdf), json.dumps(body, sort_keys=True) + "\n")


def boot_id() -> str | None:
    """The kernel's id of this boot (None: unreadable)."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return None


def clear_verdict(host: HostRoot, bdf: str) -> None:
    _path(host, bdf).unlink(missing_ok=True)


def reset(host: HostRoot, bdf: str) -> None:
    """Reset ``bdf`` through sysfs ``reset`` (``pci_reset_function``: the kernel's reset methods,
    the ones vfio-pci would use); raises ``HostError`` when the kernel refuses."""
    host.kernel.write(host, f"{sysfs.PCI_DEVICES}/{bdf}/reset", "1")
