"""Which of NVIDIA's models a node follows, and its partitions in our terms: FM's GPUs matched
to the node's by PCI address (HGX A100) or module ID (HGX H100), the partition a pod of N
GPUs is given, and the sentence a set that is no partition is refused with."""

from __future__ import annotations

import pytest

from gpunode.services import nvlinkfabric as nf
from gpunode.services.fabricmanager import FabricManager

from .conftest import H100_GPUS, H100_MODULES


def fabric(node, modules=H100_MODULES) -> nf.Fabric:
    with FabricManager.connect(node.socket, library=node.library) as fm:
        return nf.fabric_from(fm.partitions(), H100_GPUS, modules)


def test_h100_gpus_are_matched_by_module_id(h100_fm):
    fab = fabric(h100_fm)
    assert fab.sizes == (1, 2, 4, 8)
    assert [p.gpus for p in fab.partitions if p.partition_id == 3] == [("0000:03:00.0", "0000:13:00.0")]
    assert fab.unplaced == ()


def test_h100_without_module_ids_says_what_is_missing(h100_fm):
    fab = fabric(h100_fm, modules={})
    assert fab.partitions == ()
    assert "GPU module 1 without a PCI address" in fab.unplaced[0]
    assert "gpuModuleIds" in fab.unplaced[0]


def test_a100_gpus_are_matched_by_the_bus_id_fm_reports(a100_fm):
    fab = fabric(a100_fm, modules={})
    assert fab.sizes == (1, 2, 4, 8)
    assert fab.exactly(H100_GPUS[:4]).partition_id == 7


@pytest.mark.parametrize("size, expected", [(8, 0), (4, 1), (2, 3), (1, 7)])
def test_an_empty_node_gives_the_lowest_partition_of_the_size(h100_fm, size, expected):
    assert fabric(h100_fm).prefer(H100_GPUS, [], size).partition_id == expected


def test_a_small_pod_goes_where_it_blocks_fewest_larger_partitions(h100_fm):
    with FabricManager.connect(h100_fm.socket, library=h100_fm.library) as fm:
        fm.activate(3)  # GPUs 1, 3: partitions 0 and 1 blocked
        fab = nf.fabric_from(fm.partitions(), H100_GPUS, H100_MODULES)
    busy = {"0000:03:00.0", "0000:13:00.0"}
    available = [g for g in H100_GPUS if g not in busy]
    # 1 GPU: GPU 2 or 4 (partition 8 or 10) blocks only partition 4 (2, 4); GPU 5 blocks 2 and 5.
    assert fab.prefer(available, [], 1).partition_id == 8
    assert fab.prefer(available, [], 2).partition_id == 4
    assert fab.prefer(available, [], 4).partition_id == 2
    assert fab.prefer(available, [], 8) is None
    assert fab.prefer(available, ["0000:84:00.0"], 2).partition_id == 6


def test_a_set_that_is_no_partition_is_refused_naming_the_sizes(h100_fm):
    fab = fabric(h100_fm)
    assert fab.exactly(H100_GPUS[:3]) is None
    assert fab.exactly(["0000:04:00.0", "0000:14:00.0"]).partition_id == 4
    assert fab.refusal(H100_GPUS[:3]).endswith("a Kata pod here takes 1, 2, 4 or 8 GPUs")


def test_module_ids_parse_and_bad_entries_are_named():
    assert nf.parse_module_ids("1=0000:1B:00.0, 2=00000000:43:00.0") == {1: "0000:1b:00.0", 2: "0000:43:00.0"}
    with pytest.raises(ValueError, match="'17=0000:1b:00.0' must be MODULE_ID=PCI_ADDRESS"):
        nf.parse_module_ids("17=0000:1b:00.0")
    with pytest.raises(ValueError, match="module ID 1 is given twice"):
        nf.parse_module_ids("1=0000:1b:00.0,1=0000:43:00.0")


def test_the_model_follows_fm_and_kata():
    fm_down = "Fabric Manager at 127.0.0.1:6666 cannot be reached"
    shared = nf.choose("auto", nvswitches=4, fm=None, kata_takes_nvswitches=False, kata="Kata 3.29.0")
    full = nf.choose("auto", nvswitches=4, fm=fm_down, kata_takes_nvswitches=True, kata="Kata 4.1.0")
    neither = nf.choose("auto", nvswitches=4, fm=fm_down, kata_takes_nvswitches=False, kata="Kata 3.29.0")
    no_board = nf.choose("auto", nvswitches=0, fm=fm_down, kata_takes_nvswitches=False, kata="Kata 3.29.0")
    forced = nf.choose("fullPassthrough", nvswitches=4, fm=None, kata_takes_nvswitches=False, kata="Kata 3.29.0")
    assert (shared.model, shared.problem) == (nf.SHARED, None)
    assert (full.model, full.problem) == (nf.FULL, None)
    assert neither.model is None and "FABRIC_MODE=1" in neither.problem and "Kata 4.1 or later" in neither.problem
    assert (no_board.model, no_board.problem) == (None, None)
    assert forced.model is None and "§6" in forced.problem
