"""The host's health facts of a passthrough device (gpunode.host.pcihealth) read from sysfs
as Linux writes it: the simulated node's files follow the kernel's (tests/data/kernel/aer:
the files Debian's 6.1 wrote in the real-kernel suite's guest)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpunode.host import pcihealth
from gpunode.host.pcihealth import AerCounts
from gpunode.policy.health import HealthPolicy
from nodesim import pcierrors
from nodesim.materialise import materialise
from nodesim.node import open_node
from nodesim.profiles import find_profile

KERNEL_AER = Path(__file__).parents[2] / "data" / "kernel" / "aer"
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
    assert HealthPolicy().problems(facts, facts.aer) == []


def test_each_fault_is_a_fact(host):
    """What the faults leave in sysfs, read as facts (what they mean: tests/gpunode/policy)."""
    pcierrors.inject_aer(host, GPU, "correctable", "BadTLP", 4)
    facts = pcihealth.read_health(host, GPU)
    assert facts.aer.correctable == 4 and facts.aer.names("correctable") == "BadTLP 4"
    pcierrors.train_link(host, GPU, "16.0 GT/s PCIe", 8)
    link = pcihealth.read_health(host, GPU).link
    assert link.degraded and not link.down
    pcierrors.fall_off_bus(host, GPU)
    facts = pcihealth.read_health(host, GPU)
    assert facts.off_bus and facts.vendor_reads == 0xFFFF


def test_an_unknown_maximum_link_is_not_a_degraded_link(host):
    """The kernel writes "Unknown" and 255 when it cannot read the link's capabilities (seen
    in the real-kernel suite after an injected error)."""
    directory = host.path(f"/sys/bus/pci/devices/{GPU}")
    (directory / "max_link_speed").write_text("Unknown\n")
    (directory / "max_link_width").write_text("255\n")
    facts = pcihealth.read_health(host, GPU)
    assert facts.link.max_width is None and not facts.link.degraded
    assert HealthPolicy().problems(facts, facts.aer) == []
