"""``katamgr plan`` on NVSwitch boards: the NVLink fabric model chosen and why, Fabric Manager's
partitions with which are active, and a problem naming the fix where neither of NVIDIA's
models holds (docs/devices.md, "NVLink fabric")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.paths import REPO

KATAMGR = str(Path(sys.executable).parent / "katamgr")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([KATAMGR, *args], capture_output=True, text=True, cwd=REPO, timeout=120)


def fabric_of(*args: str) -> tuple[dict, list[str]]:
    result = run("plan", *args, "--output", "json")
    plan = json.loads(result.stdout)
    # plan exits 4 where it lists a problem (neither fabric model holds), else 0.
    assert result.returncode == (4 if plan["problems"] else 0), result.stderr
    return plan["nvlinkFabric"], [p["message"] if isinstance(p, dict) else p for p in plan["problems"]]


def test_dgx_h100_follows_the_shared_nvswitch_model_with_the_guides_partitions():
    fabric, problems = fabric_of("--host", "dgx-h100")
    assert fabric["model"] == "sharedNvswitch"
    assert [(p["id"], p["size"], p["active"]) for p in fabric["partitions"]][:4] == [
        (0, 8, False), (1, 4, False), (2, 4, False), (3, 2, False)]
    assert fabric["partitions"][3]["gpus"] == ["0000:03:00.0", "0000:13:00.0"]  # modules 1 and 3
    assert len(fabric["partitions"]) == 15
    assert not [p for p in problems if "NVLink" in p]


def test_a_board_whose_kata_takes_nvswitches_follows_full_passthrough():
    fabric, problems = fabric_of("--host", "hgx-h100-passthrough")
    assert fabric["model"] == "fullPassthrough"
    assert "Kata 4.1.0 cold-plugs NVSwitches" in fabric["why"]
    assert not [p for p in problems if "NVLink" in p]


def test_full_passthrough_shows_the_guides_units_each_with_its_nvswitches():
    # Fabric Manager User Guide §6.1, HGX H100: 8 GPUs with all 4 NVSwitches, or 1 GPU with none.
    result = run("plan", "--host", "hgx-h100-passthrough", "--output", "json")
    plan = json.loads(result.stdout)
    assert plan["resources"] == {"nvidia.com/GH100H100_SXM5_80GB": 8, "nvidia.com/GH100H100_SXM5_80GB_x8": 1}
    assert plan["nvlinkFabric"]["units"] == [
        {"gpus": 8, "nvswitches": 4, "offered": True, "resource": "nvidia.com/GH100H100_SXM5_80GB_x8"},
        {"gpus": 1, "nvswitches": 0, "offered": True, "resource": "nvidia.com/GH100H100_SXM5_80GB"}]
    # The board unit's one CDI entry holds every GPU's and NVSwitch's VFIO group node.
    text = " ".join(run("plan", "--host", "hgx-h100-passthrough").stdout.split())  # lines cut to the width
    assert "units (HGX H100/H200 8-GPU, Fabric Manager User Guide §6.1): a Kata pod takes 1 or 8 GPUs" in text
    assert "NVSwitches 0000:05:00.0, 0000:15:00.0, 0000:85:00.0, 0000:95:00.0)" in text
    assert "nvidia.com/GH100H100_SXM5_80GB_x8=x8-0000:03:00.0 /dev/vfio/vfio /dev/vfio/6 /dev/vfio/8 /dev/vfio/10" in text


def test_neither_model_is_a_problem_naming_both_fixes():
    # The node's FM library, pointed at a socket where no FM listens.
    fabric, problems = fabric_of("--host", "dgx-h100", "--fabric-manager-address", "/run/no-fm.sock",
                                 "--fabric-manager-library", "/usr/lib/nvidia-fabricmanager/libnvfm.so.1")
    assert fabric["model"] is None
    [problem] = [p for p in problems if "NVLink" in p]
    assert "FM_ST_CONNECTION_NOT_VALID" in problem
    assert "FABRIC_MODE=1" in problem and "Kata 4.1 or later" in problem
    # The device plugin and the DRA driver then advertise none of the board's GPUs
    # (sandbox_plugin.fabricgate): the plan promises none either.
    plan = json.loads(run("plan", "--host", "dgx-h100", "--fabric-manager-address", "/run/no-fm.sock",
                          "--fabric-manager-library", "/usr/lib/nvidia-fabricmanager/libnvfm.so.1",
                          "--output", "json").stdout)
    assert "nvidia.com/GH100H100_SXM5_80GB" not in plan["resources"]
    assert plan["nvlinkFabric"]["withheld"] == ["nvidia.com/GH100H100_SXM5_80GB"]


def test_a_bad_module_id_list_exits_2_naming_it():
    result = run("plan", "--host", "dgx-h100", "--gpu-module-ids", "1=0000:03:00.0,x")
    assert result.returncode == 2
    assert "'x'" in result.stderr


# ---- in the Shared NVSwitch model the NVSwitches stay with Fabric Manager --------------
# Fabric Manager User Guide §7: FM on the host drives the NVSwitches and only GPUs go to VMs, so
# even a Kata that cold-plugs NVSwitches (4.1+) must not be handed them here.
NVSWITCHES = ["0000:05:00.0", "0000:15:00.0", "0000:85:00.0", "0000:95:00.0"]
KEPT = "kept on the host for NVIDIA Fabric Manager (Shared NVSwitch model, Fabric Manager User Guide §7)"


def nvswitch_rows(plan: dict) -> list[dict]:
    return [d for d in plan["devices"] if d["kind"] == "nvswitch"]


def test_shared_nvswitch_keeps_the_nvswitches_on_the_host_where_kata_could_take_them():
    result = run("plan", "--host", "dgx-h100", "--kata-version", "4.1.0", "--output", "json")
    assert result.returncode == 0, result.stdout + result.stderr
    plan = json.loads(result.stdout)
    assert plan["nvlinkFabric"]["model"] == "sharedNvswitch"
    rows = nvswitch_rows(plan)
    assert [d["bdf"] for d in rows] == NVSWITCHES
    assert {(d["action"], d["driver"]) for d in rows} == {("skip", "nvidia")}
    assert all(KEPT in d["selectionMessage"] for d in rows)
    # Only the GPUs are offered: no NVSwitch, no whole-board unit with the NVSwitches in it.
    assert plan["resources"] == {"nvidia.com/GH100H100_SXM5_80GB": 8}
    assert not plan["problems"]


def test_an_explicit_shared_model_keeps_them_while_fm_does_not_answer():
    # Bound to vfio-pci, the NVSwitches would keep FM from ever starting: kept all the same.
    result = run("plan", "--host", "dgx-h100", "--kata-version", "4.1.0", "--nvlink-fabric", "sharedNvswitch",
                 "--fabric-manager-address", "/run/no-fm.sock", "--output", "json")
    plan = json.loads(result.stdout)
    assert {d["action"] for d in nvswitch_rows(plan)} == {"skip"}
    assert all(KEPT in d["selectionMessage"] for d in nvswitch_rows(plan))


def test_nvswitches_true_in_the_shared_model_is_a_problem_naming_both_settings_and_the_fix():
    fabric, problems = fabric_of("--host", "dgx-h100", "--kata-version", "4.1.0", "--nvswitches", "true")
    assert fabric["model"] == "sharedNvswitch"
    [problem] = [p for p in problems if "--nvswitches true" in p]
    assert "--nvlink-fabric" in problem and "Shared NVSwitch" in problem
    assert "--nvswitches auto" in problem and "--nvlink-fabric fullPassthrough" in problem


def test_apply_in_the_shared_model_leaves_the_nvswitches_on_their_driver(tmp_path):
    from gpunode.host.pci import read_device
    from gpunode.host.root import HostRoot
    from nodesim.materialise import materialise
    from nodesim.profiles import find_profile

    node = materialise(find_profile("dgx-h100"), tmp_path / "node")
    applied = run("apply", "--host-root", str(node.root), "--kata-version", "4.1.0", "--no-kata")
    assert applied.returncode == 0, applied.stderr
    host = HostRoot.at(node.root)
    assert {read_device(host, bdf).driver for bdf in NVSWITCHES} == {"nvidia"}
    assert read_device(host, "0000:03:00.0").driver == "vfio-pci"
    assert not (node.root / "var/run/cdi/nvidia.com-nvswitch.yaml").exists()


def test_full_passthrough_still_passes_the_nvswitches_through_in_the_board_unit():
    result = run("plan", "--host", "hgx-h100-passthrough", "--output", "json")
    plan = json.loads(result.stdout)
    assert {d["action"] for d in nvswitch_rows(plan)} == {"bind"}
    assert not [d for d in nvswitch_rows(plan) if KEPT in d["selectionMessage"]]
