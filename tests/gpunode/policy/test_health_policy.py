"""The node's health policy (gpunode.policy.health): each fact the host kernel shows of a
passthrough device, judged; an AER trip and what ends it; the hand-back check between tenants.

The facts are read from the simulated node's sysfs, written as Linux writes them
(nodesim.pcierrors, from what tests/kernel recorded on Debian's 6.1 kernel): an injected
fault leaves what the kernel's AER driver, a retrained link or a device fallen off the bus
leaves there.
"""

from __future__ import annotations

import pytest

from gpunode.host import handback, pcihealth
from gpunode.host.pcihealth import AerCounts
from gpunode.policy import health
from gpunode.policy.health import HealthPolicy, Trip
from nodesim import pcierrors
from nodesim.materialise import materialise
from nodesim.node import open_node
from nodesim.profiles import find_profile

GPU = "0000:31:00.0"  # an a10-server's A10, behind its own root port
DEGRADE, WARN = HealthPolicy("degrade"), HealthPolicy("warn")


@pytest.fixture
def host(tmp_path):
    materialise(find_profile("a10-server"), tmp_path / "node")
    return open_node(tmp_path / "node").host


def judged(host, policy: HealthPolicy = DEGRADE, baseline: AerCounts | None = None) -> list[tuple[str, bool]]:
    facts = pcihealth.read_health(host, GPU)
    return [(p.reason, p.fatal) for p in policy.problems(facts, facts.aer if baseline is None else baseline)]


def test_a_healthy_gpu_has_no_problem_under_either_link_policy(host):
    assert judged(host, DEGRADE) == judged(host, WARN) == []


# One row per fact: what the fault leaves in sysfs, the reason it is judged by, whether it
# makes the GPU Unhealthy under degrade and under warn.
FACTS = [
    ("gone", lambda h: h.path(f"/sys/bus/pci/devices/{GPU}").unlink(), health.GONE, True, True),
    ("off the bus", lambda h: pcierrors.fall_off_bus(h, GPU), health.OFF_BUS, True, True),
    ("link down", lambda h: pcierrors.train_link(h, GPU, "Unknown", 0), health.LINK_DOWN, True, True),
    ("link slower", lambda h: pcierrors.train_link(h, GPU, "8.0 GT/s PCIe", 16), health.LINK_DEGRADED, True, False),
    ("link narrower", lambda h: pcierrors.train_link(h, GPU, None, 8), health.LINK_DEGRADED, True, False),
    ("reset methods off", lambda h: pcierrors.set_reset_methods(h, GPU, ""), health.NO_RESET, True, True),
    ("no reset at all", lambda h: pcierrors.set_reset_methods(h, GPU, None), health.NO_RESET, True, True),
]


@pytest.mark.parametrize(("fault", "code", "degrade", "warn"), [row[1:] for row in FACTS],
                         ids=[row[0] for row in FACTS])
def test_each_lasting_fact_is_judged_by_its_reason(host, fault, code, degrade, warn):
    fault(host)
    assert judged(host, DEGRADE) == [(code, degrade)]
    assert judged(host, WARN) == [(code, warn)]
    found = DEGRADE.problems(pcihealth.read_health(host, GPU), None)
    assert DEGRADE.lasting(found).reason == code  # lasts while the fact does: no trip
    assert GPU in found[0].message


@pytest.mark.parametrize(("kind", "name", "code", "unfit", "word"), [
    ("fatal", "DLP", health.AER_FATAL, True, "fatal"),
    ("nonfatal", "CmpltTO", health.AER_NONFATAL, True, "non-fatal"),
    ("correctable", "BadTLP", health.AER_CORRECTABLE, False, "correctable"),
])
def test_new_aer_errors_are_judged_against_the_baseline(host, kind, name, code, unfit, word):
    before = pcihealth.read_health(host, GPU).aer
    pcierrors.inject_aer(host, GPU, kind, name, 2)
    facts = pcihealth.read_health(host, GPU)
    (problem,) = DEGRADE.problems(facts, before)
    assert (problem.reason, problem.fatal) == (code, unfit)
    assert problem.message == f"{GPU} reported 2 new {word} AER error(s) (the kernel's counts: {name} 2)"
    assert DEGRADE.lasting([problem]) is None  # a count is a trip, not a lasting fact
    assert DEGRADE.problems(facts, facts.aer) == []  # once accepted, the same counts are nothing new
    assert DEGRADE.problems(facts, None) == []  # no baseline: nothing counts as new


def test_off_the_bus_and_gone_say_only_that(host):
    """A device that does not answer has no trustworthy link or counts: one reason."""
    pcierrors.inject_aer(host, GPU, "fatal", "DLP")
    pcierrors.fall_off_bus(host, GPU)
    assert judged(host, DEGRADE, AerCounts()) == [(health.OFF_BUS, True)]


def test_problems_come_most_serious_first_in_the_one_list_of_reasons(host):
    pcierrors.inject_aer(host, GPU, "correctable", "BadTLP")
    pcierrors.inject_aer(host, GPU, "nonfatal", "CmpltTO")
    pcierrors.train_link(host, GPU, None, 8)
    pcierrors.set_reset_methods(host, GPU, "")
    found = [code for code, _ in judged(host, DEGRADE, AerCounts())]
    assert found == [health.AER_NONFATAL, health.AER_CORRECTABLE, health.LINK_DEGRADED, health.NO_RESET]
    assert set(found) <= set(health.codes())


def test_the_one_list_says_how_long_each_reason_lasts():
    assert health.codes(health.LASTING) == (health.GONE, health.OFF_BUS, health.LINK_DOWN, health.LINK_DEGRADED,
                                            health.NO_RESET)
    assert health.codes(health.WARNING) == (health.AER_CORRECTABLE,)
    assert len(set(health.codes())) == len(health.REASONS)


def test_an_unknown_link_policy_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="link policy 'strict' is not one of degrade, warn"):
        HealthPolicy("strict")


# The hand-back check: a reset through sysfs, read back under the same policy.

def test_a_hand_back_of_a_sane_gpu_passes_and_its_counts_are_the_new_baseline(host):
    pcierrors.inject_aer(host, GPU, "nonfatal", "CmpltTO")
    verdict = DEGRADE.hand_back(host, GPU, None)
    assert (verdict.ok, verdict.code, verdict.reset) == (True, "", "sysfs reset")
    assert (verdict.aer.correctable, verdict.aer.nonfatal, verdict.aer.fatal) == (0, 1, 0)


@pytest.mark.parametrize(("fault", "code", "why"), [
    (lambda h: h.path(f"/sys/bus/pci/devices/{GPU}").unlink(), health.GONE, "it is gone from the host"),
    (lambda h: pcierrors.set_reset_methods(h, GPU, ""), health.NO_RESET, "the kernel has no reset method"),
    (lambda h: pcierrors.fail_reset(h, GPU), health.HAND_BACK_FAILED, "its reset failed"),
])
def test_a_hand_back_that_cannot_reset_fails_with_the_reason(host, fault, code, why):
    fault(host)
    verdict = DEGRADE.hand_back(host, GPU, None)
    assert not verdict.ok and verdict.code == code and verdict.reason.startswith(why), verdict


def test_a_reset_brings_a_gpu_back_on_the_bus(host):
    pcierrors.fall_off_bus(host, GPU)
    assert DEGRADE.hand_back(host, GPU, None).ok  # the simulated reset restores config space


def test_a_link_the_slot_holds_low_fails_the_hand_back_only_where_it_is_unhealthy(host):
    """The same fact, the same policy, the same verdict: a link that retrains low after the
    reset fails the hand-back under degrade (as the plugin calls it Unhealthy) and passes it
    under warn (as the plugin calls it a warning)."""
    pcierrors.limit_link(host, GPU, "16.0 GT/s PCIe", 8)
    failed = DEGRADE.hand_back(host, GPU, None)
    assert not failed.ok and failed.code == health.LINK_DEGRADED
    assert "trained below its maximum: 16.0 GT/s PCIe x8" in failed.reason
    assert WARN.hand_back(host, GPU, None).ok


def test_a_failed_verdict_holds_unless_its_reason_is_only_a_warning_here(host):
    pcierrors.limit_link(host, GPU, "16.0 GT/s PCIe", 8)
    by_degrade = DEGRADE.hand_back(host, GPU, None)
    assert DEGRADE.holds(by_degrade) and not WARN.holds(by_degrade)
    pcierrors.fail_reset(host, GPU)
    reset_failed = DEGRADE.hand_back(host, GPU, None)
    assert DEGRADE.holds(reset_failed) and WARN.holds(reset_failed)
    assert not WARN.holds(None)


def test_a_verdict_keeps_its_code_through_the_file(host):
    pcierrors.limit_link(host, GPU, "16.0 GT/s PCIe", 8)
    verdict = DEGRADE.hand_back(host, GPU, None)
    handback.write_verdict(host, verdict)
    assert handback.read_verdict(host, GPU).code == health.LINK_DEGRADED


# A trip: new AER errors keep the device out until the kernel or a hand-back says it recovered.

def test_an_aer_trip_lasts_until_the_kernel_says_the_device_recovered(host):
    trip = Trip.first(pcihealth.read_health(host, GPU), None, now=1.0)
    pcierrors.inject_aer(host, GPU, "nonfatal", "CmpltTO")
    facts = pcihealth.read_health(host, GPU)
    assert trip.judge(DEGRADE, facts, None, 2.0, peek=True)[0] == health.AER_NONFATAL
    assert trip.tripped_at == 0.0  # a peek starts nothing
    assert trip.judge(DEGRADE, facts, None, 2.0)[0] == health.AER_NONFATAL
    assert trip.judge(DEGRADE, facts, None, 3.0)[0] == health.AER_NONFATAL  # the counts stay up
    trip.heard(health.BEGUN, 4.0)
    assert trip.judge(DEGRADE, facts, None, 4.5) == (health.RECOVERING,
                                                     f"the kernel is recovering {GPU} from a PCIe error")
    trip.heard(health.RECOVERED, 5.0)
    assert trip.judge(DEGRADE, facts, None, 6.0) == ("", "")
    assert trip.baseline == facts.aer  # accepted: only errors after this count


def test_a_failed_recovery_lasts_until_a_hand_back_reads_the_device_back_sane(host):
    trip = Trip.first(pcihealth.read_health(host, GPU), None, now=1.0)
    trip.heard(health.BEGUN, 2.0)
    trip.heard(health.FAILED, 3.0)
    facts = pcihealth.read_health(host, GPU)
    assert "could not recover" in trip.judge(DEGRADE, facts, None, 4.0)[1]
    verdict = DEGRADE.hand_back(host, GPU, None)
    assert trip.judge(DEGRADE, facts, verdict, verdict.checked + 1) == ("", "")


def test_a_trip_ends_at_a_hand_back_that_came_after_it(host):
    trip = Trip.first(pcihealth.read_health(host, GPU), None, now=1.0)
    pcierrors.inject_aer(host, GPU, "fatal", "DLP")
    early = DEGRADE.hand_back(host, GPU, None)  # before the trip was published
    facts = pcihealth.read_health(host, GPU)
    assert trip.judge(DEGRADE, facts, early, early.checked)[0] == health.AER_FATAL  # published now
    late = DEGRADE.hand_back(host, GPU, None)
    assert trip.judge(DEGRADE, facts, late, late.checked + 1) == ("", "")


def test_a_restarted_judge_starts_from_the_last_good_hand_back(host):
    """The counts a good hand-back read back, not today's: errors since then are still new."""
    verdict = DEGRADE.hand_back(host, GPU, None)
    pcierrors.inject_aer(host, GPU, "nonfatal", "CmpltTO")
    trip = Trip.first(pcihealth.read_health(host, GPU), verdict, now=verdict.checked + 1)
    assert trip.judge(DEGRADE, pcihealth.read_health(host, GPU), verdict, verdict.checked + 2)[0] == \
        health.AER_NONFATAL


def test_a_re_enumerated_device_counts_from_zero(host):
    pcierrors.inject_aer(host, GPU, "nonfatal", "CmpltTO", 3)
    trip = Trip.first(pcihealth.read_health(host, GPU), None, now=1.0)  # baseline 3
    pcierrors.re_enumerate(host, GPU)
    pcierrors.inject_aer(host, GPU, "nonfatal", "CmpltTO")  # 1 < 3: another device
    facts = pcihealth.read_health(host, GPU)
    assert trip.counts_fell(facts.aer)
    fresh = Trip.re_enumerated(now=2.0)
    assert fresh.judge(DEGRADE, facts, None, 3.0)[0] == health.AER_NONFATAL
