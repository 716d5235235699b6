"""The host's health facts of a passthrough device (gpunode.host.pcihealth) read from sysfs
as Linux writes it: the simulated node's files follow the kernel's (tests/data/kernel/aer:
the files Debian's 6.1 wrote in the real-kernel suite's guest)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpunode.host import pcihealth
from gpunode.host.pcihealth import AerCounts
from nodesim import pcierrors
from nodesim.materialise import materialise
from nodesim.node import open_node
from nodesim.profiles import find_profile

KERNEL_AER = Path(__file__).parents[1] / "data" / "kernel" / "aer"
GPU = "0000:31:00.0"


@pytest.fixture
def host(tmp_path):
    materialise(find_profile("a10-server"), tmp_path / "node")
    return open_node(tmp_path / "node").host


@pytest.mark.parametrize("kind", ["correctable", "nonfatal", "fatal"])
def test_the_simulated_aer_files_are_the_kernels(kind):
    name = pcierrors._FILES[kind][0]
    assert pcierrors.aer_text(kind, {}) == (KERNEL_AER / name).read_text()


def test_the_kernels_aer_files_parse_to_their_totals():
    text = (KERNEL_AER / "aer_dev_nonfatal").read_text().replace("UnsupReq 0", "UnsupReq 3")
    text = text.replace("TOTAL_ERR_NONFATAL 0", "TOTAL_ERR_NONFATAL 3")
    total, named = pcihealth.parse_aer(text)
    assert total == 3 and ("UnsupReq", 3) in named


def test_a_healthy_gpus_facts(host):
    facts = pcihealth.read_health(host, GPU)
    assert facts.aer == AerCounts(0, 0, 0)
    assert facts.link == pcihealth.Link("16.0 GT/s PCIe", 16, "16.0 GT/s PCIe", 16)
    assert facts.reset_methods == ("flr", "bus") and facts.resettable and not facts.off_bus
    assert pcihealth.problems(facts, facts.aer) == []


def test_each_fault_is_named_and_judged(host):
    before = pcihealth.read_health(host, GPU).aer
    pcierrors.inject_aer(host, GPU, "correctable", "BadTLP", 4)
    (problem,) = pcihealth.problems(pcihealth.read_health(host, GPU), before)
    assert (problem.reason, problem.fatal) == ("AerCorrectable", False)
    pcierrors.train_link(host, GPU, "16.0 GT/s PCIe", 8)
    found = pcihealth.problems(pcihealth.read_health(host, GPU), before, link_policy="warn")
    assert [(p.reason, p.fatal) for p in found] == [("AerCorrectable", False), ("LinkDegraded", False)]
    pcierrors.fall_off_bus(host, GPU)
    facts = pcihealth.read_health(host, GPU)
    assert facts.off_bus and facts.vendor_reads == 0xFFFF
    assert [p.reason for p in pcihealth.problems(facts, before)] == ["OffTheBus"]


def test_an_unknown_maximum_link_is_not_a_degraded_link(host):
    """The kernel writes "Unknown" and 255 when it cannot read the link's capabilities (seen
    in the real-kernel suite after an injected error)."""
    directory = host.path(f"/sys/bus/pci/devices/{GPU}")
    (directory / "max_link_speed").write_text("Unknown\n")
    (directory / "max_link_width").write_text("255\n")
    facts = pcihealth.read_health(host, GPU)
    assert facts.link.max_width is None and not facts.link.degraded
    assert pcihealth.problems(facts, facts.aer) == []
