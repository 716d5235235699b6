"""GetPreferredAllocation: NUMA and PCIe-switch locality on a DGX-H100-like node.

dgx-h100: NUMA 0 holds switches 0000:01:00.0 (GPUs 03, 04) and 0000:11:00.0
(13, 14); NUMA 1 holds 0000:81:00.0 (83, 84) and 0000:91:00.0 (93, 94); each
switch hangs off its own root port.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpunode.host.pciids import PciIds
from gpunode.policy.inventory import discover
from gpunode.policy.naming import Naming, resource_name
from gpunode.services.backoff import Backoff
from katamgr.pipeline.devices import apply_host
from katamgr.pipeline.plan import build_plan
from sandbox_plugin.manager import Mode, PluginManager
from sandbox_plugin.topology import Placement, placement_of, preferred

PCI_IDS = PciIds.find()
H100 = resource_name(PCI_IDS, 0x10DE, 0x2330)


def gpu(bus: str) -> str:
    return f"0000:{bus}:00.0"


SWITCH = {"03": "01", "04": "01", "13": "11", "14": "11", "83": "81", "84": "81", "93": "91", "94": "91"}
NUMA = {bus: 0 if bus < "80" else 1 for bus in SWITCH}
ALL = [gpu(b) for b in SWITCH]


@pytest.fixture(scope="module")
def dgx_placements(tmp_path_factory) -> list[Placement]:
    """Placements read from a simulated dgx-h100 through the host model."""
    from nodesim.materialise import materialise
    from nodesim.profiles import find_profile

    host = materialise(find_profile("dgx-h100"), tmp_path_factory.mktemp("dgx") / "host")
    return [placement_of(d.bdf, d) for d in discover(host).gpus]


def locality(placements, ids):
    by_id = {p.id: p for p in placements}
    return {by_id[i].numa for i in ids}, {by_id[i].switch for i in ids}


def test_placements_come_from_the_pci_tree(dgx_placements):
    assert [(p.id, p.numa, p.switch) for p in dgx_placements] == [
        (gpu(b), NUMA[b], f"0000:{SWITCH[b]}:00.0") for b in SWITCH
    ]
    assert dgx_placements[0].root_port == "0000:00:01.0"


@pytest.mark.parametrize("size", range(1, 9))
def test_every_size_is_as_local_as_the_node_allows(dgx_placements, size):
    answer = preferred(dgx_placements, ALL, [], size)
    assert len(answer) == len(set(answer)) == size
    numas, switches = locality(dgx_placements, answer)
    assert len(numas) == (1 if size <= 4 else 2)
    assert len(switches) == -(-size // 2)  # two GPUs per switch: the fewest possible


def test_exact_answers_for_common_requests(dgx_placements):
    assert preferred(dgx_placements, ALL, [], 1) == [gpu("03")]
    assert preferred(dgx_placements, ALL, [], 2) == [gpu("03"), gpu("04")]
    assert preferred(dgx_placements, ALL, [], 4) == [gpu(b) for b in ("03", "04", "13", "14")]
    assert preferred(dgx_placements, ALL, [], 8) == ALL


def test_best_fit_keeps_whole_switches_and_nodes_free(dgx_placements):
    # 03 is taken: a 2-GPU request takes the intact switch 11 on the fuller node...
    assert preferred(dgx_placements, [g for g in ALL if g != gpu("03")], [], 2) == [gpu("13"), gpu("14")]
    # ...and a 1-GPU request takes 04, the lone GPU left under switch 01.
    assert preferred(dgx_placements, [g for g in ALL if g != gpu("03")], [], 1) == [gpu("04")]
    # 14 is taken: 3 GPUs fit NUMA 0 exactly, leaving NUMA 1 whole for a 4-GPU pod.
    rest = [g for g in ALL if g != gpu("14")]
    assert preferred(dgx_placements, rest, [], 3) == [gpu("03"), gpu("04"), gpu("13")]
    assert preferred(dgx_placements, rest, [], 4) == [gpu(b) for b in ("83", "84", "93", "94")]


def test_a_fitting_switch_beats_a_smaller_but_scattered_node(dgx_placements):
    # NUMA 0 has two GPUs under two switches; NUMA 1 has a whole switch.
    available = [gpu("03"), gpu("13"), gpu("83"), gpu("84"), gpu("93")]
    assert preferred(dgx_placements, available, [], 2) == [gpu("83"), gpu("84")]


def test_must_include_devices_are_kept_and_joined(dgx_placements):
    assert preferred(dgx_placements, ALL, [gpu("84")], 2) == [gpu("84"), gpu("83")]
    answer = preferred(dgx_placements, ALL, [gpu("84")], 4)
    assert answer[0] == gpu("84") and locality(dgx_placements, answer)[0] == {1}
    answer = preferred(dgx_placements, ALL, [gpu("03"), gpu("93")], 3)
    assert answer[:2] == [gpu("03"), gpu("93")] and len(answer) == 3
    assert preferred(dgx_placements, ALL, [gpu("13"), gpu("14")], 2) == [gpu("13"), gpu("14")]


def test_fewer_available_than_asked_returns_all(dgx_placements):
    assert sorted(preferred(dgx_placements, [gpu("94"), gpu("03")], [], 4)) == [gpu("03"), gpu("94")]


def test_answer_does_not_depend_on_the_kubelets_order(dgx_placements):
    shuffled = list(ALL)
    random.Random(7).shuffle(shuffled)
    for size in range(1, 9):
        assert preferred(dgx_placements, shuffled, [], size) == preferred(dgx_placements, ALL, [], size)


def test_served_over_grpc(sim_host):
    host, kubelet = sim_host("dgx-h100")
    naming = Naming(PCI_IDS)
    assert apply_host(host, build_plan(host, naming)).ok
    manager = PluginManager(host, Mode.VM_PASSTHROUGH, naming=naming, backoff=Backoff(0.05, 2, 0.4))
    manager.start()
    try:
        state = kubelet.wait_for(lambda s: len(s.healthy(H100)) == 8)
        ids = state.healthy(H100)
        assert kubelet.preferred(H100, ids, [], 2) == [gpu("03"), gpu("04")]
        assert kubelet.preferred(H100, ids, [gpu("93")], 2) == [gpu("93"), gpu("94")]
        assert sorted(kubelet.preferred(H100, ids, [], 4)) == [gpu(b) for b in ("03", "04", "13", "14")]
    finally:
        manager.stop()


# ---- properties over arbitrary topologies ------------------------------------------

placements_st = st.lists(
    st.builds(
        Placement,
        id=st.from_regex(r"0000:[0-9a-f]{2}:00\.0", fullmatch=True),
        numa=st.one_of(st.none(), st.integers(0, 3)),
        switch=st.one_of(st.none(), st.sampled_from(["s0", "s1", "s2", "s3", "s4"])),
        root_port=st.one_of(st.none(), st.sampled_from(["r0", "r1", "r2"])),
    ),
    min_size=1,
    max_size=16,
    unique_by=lambda p: p.id,
)


@st.composite
def requests(draw):
    placements = draw(placements_st)
    ids = [p.id for p in placements]
    available = draw(st.lists(st.sampled_from(ids), min_size=1, unique=True))
    must = draw(st.lists(st.sampled_from(available), unique=True, max_size=len(available)))
    size = draw(st.integers(max(1, len(must)), len(available) + 2))
    return placements, available, must, size


@settings(max_examples=300, deadline=None)
@given(requests())
def test_answers_are_valid_subsets(request):
    placements, available, must, size = request
    answer = preferred(placements, available, must, size)
    assert len(answer) == len(set(answer)) == min(size, len(available))
    assert set(answer) <= set(available)
    assert set(must) <= set(answer)
    assert answer[: len(must)] == must
    # Deterministic whatever order the kubelet lists the devices in.
    assert preferred(placements, list(reversed(available)), must, size) == answer


@settings(max_examples=300, deadline=None)
@given(requests())
def test_a_request_one_numa_node_can_hold_stays_on_one(request):
    placements, available, _must, size = request
    numa_of = {p.id: p.numa for p in placements}
    per_node: dict = {}
    for i in available:
        per_node[numa_of[i]] = per_node.get(numa_of[i], 0) + 1
    answer = preferred(placements, available, [], size)
    if any(count >= size for count in per_node.values()):
        assert len({numa_of[i] for i in answer}) == 1
