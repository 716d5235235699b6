"""katamgr's Fabric Manager client against the SDK's contract (the stand-in libnvfm built from
the guide's declarations): what FM answers and refuses, by the guide's section."""

from __future__ import annotations

import ctypes
import ctypes.util
import time

import pytest

from gpunode.services import fabricmanager as fmc
from gpunode.services.fabricmanager import FabricManager, FabricManagerError


def connect(node, **kw) -> FabricManager:
    return FabricManager.connect(node.socket, library=node.library, **kw)


def test_h100_partitions_are_the_guides_table_by_module_id(h100_fm):
    # Guide, "GPU Partitions", DGX H100 and HGX H100: 15 partitions; §5.1's note: on H100
    # FM leaves pciBusId and uuid empty.
    with connect(h100_fm) as fm:
        found = {p.partition_id: [g.physical_id for g in p.gpus] for p in fm.partitions()}
        gpu = fm.partitions()[0].gpus[0]
    assert found == {0: [1, 2, 3, 4, 5, 6, 7, 8], 1: [1, 2, 3, 4], 2: [5, 6, 7, 8], 3: [1, 3], 4: [2, 4],
                     5: [5, 7], 6: [6, 8], **{7 + i: [1 + i] for i in range(8)}}
    assert (gpu.pci_bus_id, gpu.uuid, gpu.max_nvlinks) == ("", "", 18)


def test_a100_reports_bus_ids_and_only_partitions_of_present_gpus(a100_fm):
    # One baseboard (physical IDs 1-8): FM drops the partitions of absent GPUs 9-16.
    with connect(a100_fm) as fm:
        parts = fm.partitions()
    assert sorted(p.partition_id for p in parts) == [1, 7, 8, 11, 12, 13, 14, *range(19, 27)]
    assert parts[0].gpus[0].pci_bus_id == "00000000:03:00.0"


def test_activation_refuses_what_fm_refuses(h100_fm):
    with connect(h100_fm) as fm:
        fm.activate(3)  # GPUs 1 and 3
        with pytest.raises(FabricManagerError) as overlap:
            fm.activate(1)  # GPUs 1-4 overlap it (§5.7: FM_ST_IN_USE)
        with pytest.raises(FabricManagerError) as again:
            fm.activate(3)
        with pytest.raises(FabricManagerError) as unknown:
            fm.activate(40)
        fm.activate(4)  # GPUs 2 and 4: disjoint
        fm.deactivate(3)
        with pytest.raises(FabricManagerError) as inactive:
            fm.deactivate(3)  # §5.9: FM_ST_UNINITIALIZED, "specified partition is not activated"
    assert overlap.value.name == again.value.name == "FM_ST_IN_USE"
    assert "one of its GPUs is in another active partition" in str(overlap.value)
    assert unknown.value.name == "FM_ST_BADPARAM"
    assert inactive.value.name == "FM_ST_UNINITIALIZED"
    assert h100_fm.active() == [4]


def test_every_process_sees_one_fabric(h100_fm):
    with connect(h100_fm) as first, connect(h100_fm) as second:
        first.activate(1)
        assert [p.partition_id for p in second.partitions() if p.active] == [1]
        with pytest.raises(FabricManagerError):
            second.activate(0)


def test_fm_not_running_is_named(h100_fm):
    h100_fm.stop()
    with pytest.raises(FabricManagerError) as err:
        connect(h100_fm)
    assert err.value.name == "FM_ST_CONNECTION_NOT_VALID"
    assert "cannot be reached" in str(err.value)


def test_fm_in_bare_metal_mode_is_not_supported(tmp_path):
    from nodesim import fabricmanager as fmsim

    from .conftest import H100_MODULES, FmNode

    node = FmNode(tmp_path, fmsim.FabricManagerSpec("hgx-h100", "baremetal", H100_MODULES))
    with connect(node) as fm, pytest.raises(FabricManagerError) as err:
        fm.partitions()
    assert err.value.name == "FM_ST_NOT_SUPPORTED"
    assert "FABRIC_MODE=1" in str(err.value)


def test_restarted_fm_waits_for_the_active_list(h100_fm):
    # Guide "Resiliency" and §5.10: after --restart FM rejects partition calls until told.
    with connect(h100_fm) as fm:
        fm.activate(2)
    h100_fm.restart()
    with connect(h100_fm) as fm:
        with pytest.raises(FabricManagerError) as err:
            fm.activate(7)
        fm.set_activated([2])
        assert [p.partition_id for p in fm.partitions() if p.active] == [2]
        with pytest.raises(FabricManagerError) as bad:
            fm.set_activated([99])
    assert err.value.name == "FM_ST_NOT_CONFIGURED"
    assert bad.value.name == "FM_ST_BADPARAM"


def test_a_call_fm_does_not_answer_is_given_up_on(h100_fm):
    with connect(h100_fm, timeout=0.3) as fm:
        h100_fm.delay(3000)
        started = time.monotonic()
        with pytest.raises(FabricManagerError) as err:
            fm.partitions()
        took = time.monotonic() - started
        with pytest.raises(FabricManagerError):
            fm.activate(7)  # the handle may still be in use: never reused
    h100_fm.delay(0)
    assert "did not answer fmGetSupportedFabricPartitions within 0.3 s" in str(err.value)
    assert took < 2.5


def test_not_the_fm_library_is_named(tmp_path):
    with pytest.raises(FabricManagerError) as err:
        fmc.load(str(tmp_path / "libnvfm.so.1"))
    assert "cannot be loaded" in str(err.value) and "libnvfm.so.1" in str(err.value)
    libc = ctypes.util.find_library("c")
    with pytest.raises(FabricManagerError) as wrong:
        fmc.load(libc)
    assert "has no fmLibInit" in str(wrong.value)


def test_every_return_code_has_a_name():
    # nv_fm_types.h: 0 to -10 in the guide's SDK, -11 to -22 in newer ones.
    assert [fmc.return_name(c) for c in range(0, -23, -1)][:11] == [
        "FM_ST_SUCCESS", "FM_ST_BADPARAM", "FM_ST_GENERIC_ERROR", "FM_ST_NOT_SUPPORTED", "FM_ST_UNINITIALIZED",
        "FM_ST_TIMEOUT", "FM_ST_VERSION_MISMATCH", "FM_ST_IN_USE", "FM_ST_NOT_CONFIGURED",
        "FM_ST_CONNECTION_NOT_VALID", "FM_ST_NVLINK_ERROR"]
    assert all(not fmc.return_name(c).startswith("fmReturn_t") for c in range(0, -23, -1))


def test_ctypes_layouts_match_the_header(tmp_path):
    # The versions FM checks carry sizeof(struct): ours must be the C compiler's.
    import shutil
    import subprocess

    from nodesim import fabricmanager as fmsim

    program = tmp_path / "sizes.c"
    program.write_text('#include <stdio.h>\n#include "nvfm_sdk.h"\nint main(void){printf("%zu %zu %zu %zu %zu\\n",'
                       "sizeof(fmConnectParams_v1), sizeof(fmConnectParams_v2), sizeof(fmFabricPartitionList_t),"
                       "sizeof(fmActivatedFabricPartitionList_t), sizeof(fmFabricPartitionGpuInfo_t));return 0;}\n")
    subprocess.run([shutil.which("gcc"), f"-I{fmsim.HERE}", "-o", str(tmp_path / "sizes"), str(program)],
                   check=True, timeout=60)
    sizes = subprocess.run([str(tmp_path / "sizes")], capture_output=True, text=True, check=True).stdout.split()
    assert [int(s) for s in sizes] == [ctypes.sizeof(t) for t in (
        fmc.ConnectParamsV1, fmc.ConnectParamsV2, fmc.PartitionList, fmc.ActivatedList, fmc.PartitionGpuInfo)]
