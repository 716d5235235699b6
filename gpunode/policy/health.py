"""A passthrough device's health: the one policy that turns the host kernel's facts into a verdict.

The facts are ``gpunode.host.pcihealth``'s (AER counts, the link, config space, reset methods,
presence); the hand-back verdict file is ``gpunode.host.handback``'s. Everything that decides
what they mean is here, and read by every judge: the device plugin and the DRA driver
(``sandbox_plugin.devhealth``: Healthy or Unhealthy at ListAndWatch, in or out of the slice),
the agent (``katamgr.agent.gpuhealth``: its Events, its metrics, the hand-back check between
tenants) and ``katamgr plan``. NVIDIA's k8s-device-plugin keeps its health rule in one place
for the same reason: two judges of the same facts drift.

- ``REASONS``: the one list of reasons a device is unfit (or worth a warning), as Events,
  metrics' ``reason`` labels and the plugin's log name them;
- ``HealthPolicy.problems``: facts against a baseline of AER counts -> problems, most serious
  first; ``link`` says whether a link trained below its maximum makes the device Unhealthy
  (``degrade``) or is only a warning (``warn``);
- ``HealthPolicy.hand_back``: the check between tenants (reset through sysfs, read back),
  judged by the same ``problems``, so a fact the plugin calls a warning never fails it;
- ``Trip``: one device's AER trip and its recovery, as the plugin follows them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from gpunode.host import handback, pcihealth, vfio
from gpunode.host.errors import HostError
from gpunode.host.handback import Verdict
from gpunode.host.pcihealth import AerCounts, PciHealth
from gpunode.host.root import HostRoot

LINK_POLICIES = ("degrade", "warn")  # a link below its maximum: Unhealthy, or a warning only
DEFAULT_LINK_POLICY = "degrade"
# What each value means, for the three programs, the config's devices.linkPolicy and the chart.
LINK_POLICY_MEANING = (
    "a passthrough GPU whose PCIe link trained below its maximum (speed or width) is Unhealthy: "
    "degrade (the default), where the device plugin and the DRA driver stop offering it and the "
    "agent's hand-back check between tenants fails it; or warn, where all three only log and count "
    "it. A link that is down is Unhealthy either way")

# How long a reason lasts: while the fact does (LASTING), until the kernel or a hand-back says
# the device recovered (TRIP: AER counts never go down), until a later hand-back passes
# (HAND_BACK), or never Unhealthy (WARNING).
LASTING, TRIP, HAND_BACK, WARNING = "lasting", "trip", "hand-back", "warning"


@dataclass(frozen=True)
class Reason:
    code: str  # as Events, the metrics' reason label and the plugin's log name it
    means: str
    lasts: str  # LASTING, TRIP, HAND_BACK or WARNING


GONE = "Gone"
OFF_BUS = "OffTheBus"
AER_FATAL = "AerFatal"
AER_NONFATAL = "AerNonFatal"
LINK_DOWN = "LinkDown"
LINK_DEGRADED = "LinkDegraded"
NO_RESET = "NoResetMethod"
HAND_BACK_FAILED = "HandBackFailed"
RECOVERING = "AerRecovery"  # between the kernel's BEGIN_RECOVERY and its SUCCESSFUL_RECOVERY
AER_CORRECTABLE = "AerCorrectable"
# The kernel's error-recovery uevents (ERROR_EVENT=, include/linux/pci.h, pci_uevent_ers).
BEGUN, RECOVERED, FAILED = "BEGIN_RECOVERY", "SUCCESSFUL_RECOVERY", "FAILED_RECOVERY"

# The one list, most serious first (the order ``problems`` reports in).
REASONS = (
    Reason(GONE, "gone from the host (hot-unplugged or removed)", LASTING),
    Reason(OFF_BUS, "config space reads 0xffff: the device fell off the bus", LASTING),
    Reason(AER_FATAL, "new fatal AER errors since the counts were last accepted", TRIP),
    Reason(AER_NONFATAL, "new non-fatal AER errors since the counts were last accepted", TRIP),
    Reason(LINK_DOWN, "the PCIe link is down", LASTING),
    Reason(LINK_DEGRADED, "the PCIe link trained below its maximum (Unhealthy with link policy degrade)", LASTING),
    Reason(NO_RESET, "no reset method the kernel can use, so vfio-pci cannot reset it between tenants", LASTING),
    Reason(HAND_BACK_FAILED, "failed its hand-back check between tenants", HAND_BACK),
    Reason(RECOVERING, "the kernel is recovering it from a PCIe error, or could not", TRIP),
    Reason(AER_CORRECTABLE, "new correctable AER errors: counted and rate-alerted, never Unhealthy", WARNING),
)
_BY_CODE = {r.code: r for r in REASONS}
_AER = (AER_FATAL, AER_NONFATAL)


def codes(*lasts: str) -> tuple[str, ...]:
    """The reasons' codes, in ``REASONS``' order, of those that last as ``lasts`` says (all: none given)."""
    return tuple(r.code for r in REASONS if not lasts or r.lasts in lasts)


@dataclass(frozen=True)
class Problem:
    reason: str  # a code of ``REASONS``
    message: str  # a sentence naming the device
    fatal: bool  # makes the device Unhealthy (else a warning)


@dataclass(frozen=True)
class HealthPolicy:
    """How this node judges its passthrough devices; every judge holds an equal one."""

    link: str = DEFAULT_LINK_POLICY

    def __post_init__(self) -> None:
        if self.link not in LINK_POLICIES:
            raise ValueError(f"link policy {self.link!r} is not one of {', '.join(LINK_POLICIES)}: "
                             f"{LINK_POLICIES[0]} makes a GPU whose link trained low Unhealthy, "
                             f"{LINK_POLICIES[1]} only warns")

    def problems(self, facts: PciHealth, baseline: AerCounts | None) -> list[Problem]:
        """What makes the device unfit for a VM now (``fatal``) or worth a warning, most
        serious first. ``baseline``: the AER counts last accepted as healthy (None: none new)."""
        bdf = facts.bdf
        if not facts.present:
            return [Problem(GONE, f"{bdf} is gone from the host (hot-unplugged or removed)", True)]
        if facts.off_bus:
            return [Problem(OFF_BUS, f"{bdf} fell off the bus: its config space reads 0xffff", True)]
        found: list[Problem] = []
        if facts.aer is not None:
            cor, nonfatal, fatal = facts.aer.rise(baseline)
            for code, count, kind, word, unfit in ((AER_FATAL, fatal, "fatal", "fatal", True),
                                                   (AER_NONFATAL, nonfatal, "nonfatal", "non-fatal", True),
                                                   (AER_CORRECTABLE, cor, "correctable", "correctable", False)):
                if count:
                    found.append(Problem(code, f"{bdf} reported {count} new {word} AER error(s) "
                                         f"(the kernel's counts: {facts.aer.names(kind) or 'unnamed'})", unfit))
        link = facts.link
        if link is not None and link.down:
            found.append(Problem(LINK_DOWN, f"{bdf}'s PCIe link is down ({link.describe()})", True))
        elif link is not None and link.degraded:
            found.append(Problem(LINK_DEGRADED, f"{bdf}'s PCIe link trained below its maximum: {link.describe()}",
                                 self.link == "degrade"))
        if not facts.resettable:
            why = "reset_method is empty" if facts.reset_methods == () else "no reset or reset_method attribute"
            found.append(Problem(NO_RESET, f"{bdf} has no reset method the kernel can use ({why}), "
                                 "so vfio-pci cannot reset it between tenants", True))
        return found

    @staticmethod
    def lasting(found: list[Problem]) -> Problem | None:
        """The first problem that makes the device Unhealthy for as long as its fact lasts (an
        AER count is a trip instead: ``Trip``)."""
        return next((p for p in found if p.fatal and _BY_CODE[p.reason].lasts == LASTING), None)

    def holds(self, verdict: Verdict | None) -> bool:
        """A failed hand-back verdict keeps the device out, unless what failed it is a fact this
        policy calls a warning (a verdict written by a judge under another link policy)."""
        if verdict is None or verdict.ok:
            return False
        return not (verdict.code == LINK_DEGRADED and self.link != "degrade")

    def after_reset(self, before: PciHealth, after: PciHealth) -> Problem | None:
        """What, read back after the hand-back's reset, keeps the device out. Non-fatal AER
        errors are not held against it: they are counted against the counts just before the
        reset, which the reset itself may raise (the read-back's counts become the plugin's
        new baseline)."""
        return next((p for p in self.problems(after, before.aer) if p.fatal and p.reason != AER_NONFATAL), None)

    def hand_back(self, host: HostRoot, bdf: str, group: int | None) -> Verdict | None:
        """Reset ``bdf`` through sysfs and read it back (``gpunode.host.handback``); None while a
        process still holds its VFIO nodes (its VM is still letting go: look again later)."""
        started = time.monotonic()
        if vfio.vfio_holders(host, bdf, group):
            return None
        before = pcihealth.read_health(host, bdf)

        def verdict(code: str, reason: str, reset: str, aer: AerCounts | None) -> Verdict:
            return Verdict(bdf, not code, reason, time.time(), aer, reset, time.monotonic() - started, code)

        if not before.present:
            return verdict(GONE, "it is gone from the host", "none: gone", None)
        if not before.resettable:
            return verdict(NO_RESET, "the kernel has no reset method for it, so the last tenant's state stays",
                           "none: no reset method", before.aer)
        try:
            handback.reset(host, bdf)
        except HostError as exc:
            return verdict(HAND_BACK_FAILED, f"its reset failed ({exc})", "sysfs reset failed", before.aer)
        after = pcihealth.read_health(host, bdf)
        bad = self.after_reset(before, after)
        if bad is not None:
            return verdict(bad.reason, f"after its reset: {bad.message}", "sysfs reset", after.aer)
        return verdict("", "", "sysfs reset", after.aer)


@dataclass
class Trip:
    """One device's AER baseline, its trip until recovery, and the kernel's recovery events.

    AER counts never go down while the device stays enumerated, so an AER trip ends only when
    the device is known sane again: the kernel said it recovered (``SUCCESSFUL_RECOVERY``, sent
    by drivers/pci/pcie/err.c once every driver below the port resumed) after the trip, or a
    hand-back check reset it and read it back sane after the trip. Either is honoured only once
    the trip was published, and only while nothing else is wrong; the counts of that moment are
    the new baseline. Between the kernel's BEGIN_RECOVERY and its SUCCESSFUL_RECOVERY the device
    is Unhealthy, and after a FAILED_RECOVERY until a hand-back reads it back sane. Times are
    wall times: a verdict file's time is one."""

    baseline: AerCounts | None = None
    accepted_at: float = 0.0  # when the baseline was accepted
    tripped_at: float = 0.0  # when an AER problem was published; 0: none
    recovered_at: float = 0.0  # the last SUCCESSFUL_RECOVERY the kernel announced for it
    begun_at: float = 0.0  # the last BEGIN_RECOVERY
    failed: bool = False  # a FAILED_RECOVERY on it or a bridge above it since then

    @classmethod
    def first(cls, facts: PciHealth, verdict: Verdict | None, now: float) -> Trip:
        """A judge (re)started: the counts the last good hand-back saw, else today's."""
        return cls(baseline=(verdict.aer if verdict is not None and verdict.ok else None) or facts.aer,
                   accepted_at=now)

    @classmethod
    def re_enumerated(cls, now: float) -> Trip:
        """The device was enumerated again (remove and rescan, a hot-plug): the kernel allocated
        its AER counts afresh at zero (``pci_aer_init``), so every error it counts is new, and
        what the one before reported, and its trip, are gone."""
        return cls(baseline=AerCounts(), accepted_at=now)

    def counts_fell(self, aer: AerCounts | None) -> bool:
        """Counts below the baseline: they never go down while the device stays, so it is another."""
        base = self.baseline
        return aer is not None and base is not None and (
            aer.fatal < base.fatal or aer.nonfatal < base.nonfatal or aer.correctable < base.correctable)

    def heard(self, event: str, now: float) -> None:
        """The kernel's recovery event (``BEGIN_RECOVERY``, ``SUCCESSFUL_RECOVERY``,
        ``FAILED_RECOVERY``) on this device, or a failure on a port above it."""
        if event == BEGUN:
            self.begun_at, self.failed = now, False
        elif event == RECOVERED:
            self.recovered_at = now
        elif event == FAILED:
            self.failed = True

    def judge(self, policy: HealthPolicy, facts: PciHealth, verdict: Verdict | None, now: float, *,
              peek: bool = False) -> tuple[str, str]:
        """(code, message) of why the device is unfit now, ("", "") when it is fit; unless
        ``peek``, a trip starts or ends here."""
        bdf = facts.bdf
        found = policy.problems(facts, self.baseline)
        other = policy.lasting(found)
        if other is not None:
            return other.reason, other.message
        if policy.holds(verdict):
            return HAND_BACK_FAILED, f"{bdf} failed its hand-back check: {verdict.reason}"
        ok_at = verdict.checked if verdict is not None and verdict.ok else 0.0
        if self.begun_at > max(self.recovered_at, ok_at):
            return RECOVERING, (f"the kernel could not recover {bdf} from a PCIe error (FAILED_RECOVERY)"
                                if self.failed else f"the kernel is recovering {bdf} from a PCIe error")
        aer = next((p for p in found if p.reason in _AER), None)
        if aer is None:
            return "", ""
        recovered = self.tripped_at and (
            self.recovered_at > self.accepted_at
            or (verdict is not None and verdict.ok and verdict.checked > self.tripped_at))
        if recovered:
            if not peek:
                self.baseline, self.accepted_at, self.tripped_at = facts.aer, now, 0.0
            return "", ""
        if not peek and not self.tripped_at:
            self.tripped_at = now
        return aer.reason, aer.message

    def copy(self) -> Trip:
        return replace(self)
