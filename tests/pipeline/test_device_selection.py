"""Device selection as an operator sees it: what plan says about each device, what apply binds
and leaves alone, the CDI specs written, and that revert undoes whatever was bound."""

from __future__ import annotations

import pytest
from support.hostkit import (
    AUDIO_A6000,
    GPU_A10,
    GPU_A6000,
    ROOT_PORT,
    dev,
    driver_of,
    make_host,
    snapshot,
)

from gpunode.host.pciids import PciIds
from gpunode.policy.katarelease import parse_release
from gpunode.policy.naming import Naming
from gpunode.policy.selection import NvswitchRule, Selection, parse_exclude, parse_include
from katamgr.pipeline.reconcile import Steps, full_plan, reconcile, revert_all
from katamgr.render import plan_text
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

PCI_IDS = PciIds.find()
EDU = {"vendor": 0x1234, "device": 0x11E8, "class": 0x00FF00}
STANDINS = ["1234:11e8=example.com/edu", "1234:1111=example.com/vga"]


def naming(*, include=(), exclude=(), origin: str | None = None) -> Naming:
    include_rules = tuple(parse_include(t, *([origin] if origin else [])) for t in include)
    exclude_rules = tuple(parse_exclude(t, *([origin] if origin else [])) for t in exclude)
    return Naming(PCI_IDS, selection=Selection(include_rules, exclude_rules))


def rows(plan) -> dict[str, dict]:
    return {d["bdf"]: d for d in plan.to_json()["devices"]}


def workstation(tmp_path):
    """A display GPU with its audio function, and a second GPU for VMs."""
    return make_host(tmp_path, [
        dev("0000:00:01.0", ROOT_PORT, "pcieport", 1),
        dev("0000:01:00.0", GPU_A6000, "nvidia", 15, parent="0000:00:01.0", minor=0),
        dev("0000:01:00.1", AUDIO_A6000, "snd_hda_intel", 15, parent="0000:00:01.0"),
        dev("0000:02:00.0", GPU_A10, "nvidia", 16, minor=1),
    ])


def test_the_default_selection_is_the_gpus_and_the_nvswitches_kata_can_take(tmp_path):
    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    plan = full_plan(host, Naming(PCI_IDS), Steps(), None)
    by_kind: dict[str, set[str]] = {}
    for row in plan.to_json()["devices"]:
        by_kind.setdefault(row["kind"], set()).add(row["selection"])
    assert by_kind["gpu"] == {"NVIDIA GPU (default selection)"}
    # The node's Kata release is unknown: NVSwitches stay on the host (Kata before 4.1 fails them),
    # listed as what they are.
    assert by_kind["nvswitch"] == {"NVIDIA NVSwitch, not passed through: Kata before 4.1 cannot cold-plug one, "
                                   "and --kata-version does not say the node runs a later release"}
    assert {d.action for d in plan.devices if d.kind == "nvswitch"} == {"skip"}
    assert set(by_kind) <= {"gpu", "nvswitch", "companion", "other"}
    assert plan.resources == {"nvidia.com/GH100H100_SXM5_80GB": 8}
    assert any(w.startswith("NVSwitches 0000:05:00.0, 0000:15:00.0, 0000:85:00.0, 0000:95:00.0 stay on "
                            "their drivers") for w in plan.warnings)
    assert reconcile(host, Naming(PCI_IDS), Steps(), None).ok
    assert host.path("/var/run/cdi/nvidia.com-pgpu.yaml").exists()
    assert not host.path("/var/run/cdi/nvidia.com-nvswitch.yaml").exists()


@pytest.mark.parametrize(("mode", "kata", "taken", "warned"), [
    ("auto", "4.1.0", True, False),  # a Kata that cold-plugs them
    ("auto", "3.29.0", False, False),
    (True, "3.25.0", True, True),  # the operator's call, with the warning
    (False, "4.1.0", False, False),
])
def test_nvswitches_follow_the_node_s_kata_and_the_operator(tmp_path, mode, kata, taken, warned):
    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    chosen = Naming(PCI_IDS, selection=Selection(nvswitches=mode), nvswitch_rule=NvswitchRule(parse_release(kata)))
    plan = full_plan(host, chosen, Steps(), None)
    board = "nvidia.com/GH100H100_SXM5_80GB_x8"
    assert bool({"nvidia.com/PCI_22a3", board} & set(plan.resources)) is taken
    # Kata 4.1 takes them in the full passthrough model: only with the whole board, as one unit
    # (Fabric Manager User Guide §6.1; gpunode.policy.nvlinkunits).
    assert (board in plan.resources) is (taken and kata == "4.1.0")
    assert any("a pod given an NVSwitch will not start" in w for w in plan.warnings) is warned
    if mode is False:
        assert rows(plan)["0000:05:00.0"]["selection"] == "NVIDIA NVSwitch, not passed through (--nvswitches false)"


def test_a_display_gpu_excluded_by_bdf_stays_on_its_driver_and_plan_says_why(tmp_path):
    host = workstation(tmp_path)
    chosen = naming(exclude=["0000:01:00.0"])
    plan = full_plan(host, chosen, Steps(), None)
    display = rows(plan)["0000:01:00.0"]
    assert (display["kind"], display["action"], display["resource"]) == ("excluded", "skip", None)
    assert display["selection"] == "excluded by --exclude-device 0000:01:00.0"
    assert display["reason"] == "excluded from passthrough: stays on its driver"
    assert "0000:01:00.1" not in rows(plan)  # its audio function travels with no passthrough device
    assert rows(plan)["0000:02:00.0"]["action"] == "bind"
    assert plan.resources == {"nvidia.com/GA102GL_A10": 1}
    assert "excluded by --exclude-device 0000:01:00.0" in plan_text(plan, wide=True)

    assert reconcile(host, chosen, Steps(), None).ok
    assert (driver_of(host, "0000:01:00.0"), driver_of(host, "0000:01:00.1")) == ("nvidia", "snd_hda_intel")
    assert driver_of(host, "0000:02:00.0") == "vfio-pci"
    spec = host.path("/var/run/cdi/nvidia.com-pgpu.yaml").read_text()
    assert "/dev/vfio/16" in spec and "/dev/vfio/15" not in spec  # pgpu=0 is the second GPU
    assert reconcile(host, chosen, Steps(), None).changes == []  # and it stays that way


def test_excluded_by_ids_from_the_config(tmp_path):
    host = workstation(tmp_path)
    chosen = naming(exclude=["10DE:2230"], origin="config devices.exclude")
    plan = full_plan(host, chosen, Steps(), None)
    assert rows(plan)["0000:01:00.0"]["selection"] == "excluded by config devices.exclude 10de:2230"
    assert reconcile(host, chosen, Steps(), None).ok
    assert driver_of(host, "0000:01:00.0") == "nvidia" and driver_of(host, "0000:02:00.0") == "vfio-pci"


def test_a_group_shared_with_an_excluded_device_is_refused_saying_so(tmp_path):
    host = workstation(tmp_path)
    chosen = naming(exclude=["0000:01:00.1"])
    plan = full_plan(host, chosen, Steps(), None)
    gpu, audio = rows(plan)["0000:01:00.0"], rows(plan)["0000:01:00.1"]
    assert gpu["action"] == "skip" and gpu["selection"] == "NVIDIA GPU (default selection)"
    assert gpu["reason"] == ("IOMMU group 15 is not viable: it also holds 0000:01:00.1 (10de:1aef, driver "
                             "snd_hda_intel, excluded by --exclude-device 0000:01:00.1), which is not ours to bind")
    assert (audio["kind"], audio["action"]) == ("excluded", "skip")
    assert any(p.startswith("0000:01:00.0: IOMMU group 15 is not viable") for p in plan.problems)
    before = snapshot(host)
    report = reconcile(host, chosen, Steps(vfio=True, cdi=False), None)
    assert driver_of(host, "0000:01:00.0") == "nvidia"
    assert driver_of(host, "0000:02:00.0") == "vfio-pci"
    assert any("excluded by --exclude-device 0000:01:00.1" in w for w in report.warnings)
    changed = {k for k in set(before) | set(snapshot(host)) if before.get(k) != snapshot(host).get(k)}
    assert not any("0000:01:00" in path for path in changed)


def test_an_excluded_device_without_a_driver_still_blocks_its_group(tmp_path):
    # The kernel would let a VM take a group with a driverless device in it; an operator
    # who excluded that device asked for it to stay out of every VM.
    host = make_host(tmp_path, [
        dev("0000:01:00.0", GPU_A10, "nvidia", 4, minor=0),
        dev("0000:01:00.1", EDU, None, 4),
    ])
    plan = full_plan(host, naming(exclude=["1234:11e8"]), Steps(), None)
    assert rows(plan)["0000:01:00.0"]["action"] == "skip"
    assert "excluded by --exclude-device 1234:11e8" in rows(plan)["0000:01:00.0"]["reason"]


def test_an_included_stand_in_is_bound_and_gets_its_own_cdi_spec(tmp_path):
    host = materialise(find_profile("qemu-standins"), tmp_path / "host")
    chosen = naming(include=STANDINS, exclude=["0000:00:01.0"])
    plan = full_plan(host, chosen, Steps(), None)
    edu = rows(plan)["0000:01:00.0"]
    assert (edu["kind"], edu["action"], edu["resource"]) == ("included", "bind", "example.com/edu")
    assert edu["selection"] == "included by --include-device 1234:11e8 as example.com/edu"
    shared = rows(plan)["0000:04:01.0"]
    assert shared["action"] == "skip" and "0000:04:02.0 (8086:100e, driver e1000)" in shared["reason"]
    assert rows(plan)["0000:00:01.0"]["selection"] == "excluded by --exclude-device 0000:00:01.0"
    assert plan.resources == {"example.com/edu": 1, "example.com/vga": 1}
    cdi = next(s for s in plan.sections if s.key == "cdi").data
    assert [c["name"] for c in cdi["cold_plug"]] == ["example.com/edu=0000:01:00.0",
                                                     "example.com/vga=0000:02:00.0"]

    report = reconcile(host, chosen, Steps(), None)
    assert report.ok, report.failures
    assert driver_of(host, "0000:01:00.0") == "vfio-pci" and driver_of(host, "0000:02:00.0") == "vfio-pci"
    assert driver_of(host, "0000:00:01.0") == "bochs-drm" and driver_of(host, "0000:04:02.0") == "e1000"
    assert driver_of(host, "0000:04:01.0") is None
    specs = sorted(p.name for p in host.path("/var/run/cdi").iterdir())
    assert specs == ["example.com-edu.yaml", "example.com-vga.yaml"]  # no nvidia.com/pgpu: no GPU
    assert "name: '0000:01:00.0'" in host.path("/var/run/cdi/example.com-edu.yaml").read_text()

    # revert undoes what katamgr recorded, whatever the selection is now.
    undone = revert_all(host, Steps(), None)
    assert undone.ok, undone.failures
    assert driver_of(host, "0000:01:00.0") is None and driver_of(host, "0000:02:00.0") == "bochs-drm"
    assert not list(host.path("/var/run/cdi").iterdir())


def test_an_included_gpu_is_advertised_under_the_given_name(tmp_path):
    host = workstation(tmp_path)
    plan = full_plan(host, naming(include=["10de:2236=example.com/a10"]), Steps(), None)
    assert plan.resources == {"example.com/a10": 1, "nvidia.com/GA102GL_RTX_A6000": 1}
    a10 = rows(plan)["0000:02:00.0"]
    assert (a10["kind"], a10["resource"]) == ("gpu", "example.com/a10")


def test_rules_that_match_nothing_and_unseen_users_are_warned_about_in_plan_and_apply(tmp_path):
    host = materialise(find_profile("qemu-standins"), tmp_path / "host")
    chosen = naming(include=[*STANDINS, "1af4:9999=example.com/nope"], exclude=["0000:09:00.0"])
    plan = full_plan(host, chosen, Steps(), None)
    assert "--exclude-device 0000:09:00.0 matches no device on this host" in plan.warnings
    assert "--include-device 1af4:9999=example.com/nope matches no device on this host" in plan.warnings
    vga = next(w for w in plan.warnings if w.startswith("0000:02:00.0 is on bochs-drm"))
    assert "check that nothing uses it" in vga
    report = reconcile(host, chosen, Steps(), None)
    assert "--exclude-device 0000:09:00.0 matches no device on this host" in report.warnings


def test_excluding_a_device_katamgr_bound_says_how_to_give_it_back(tmp_path):
    host = materialise(find_profile("qemu-standins"), tmp_path / "host")
    assert reconcile(host, naming(include=STANDINS), Steps(), None).ok
    plan = full_plan(host, naming(include=STANDINS, exclude=["1234:11e8"]), Steps(), None)
    reason = rows(plan)["0000:01:00.0"]["reason"]
    assert "katamgr bound it to vfio-pci earlier" in reason and "katamgr revert" in reason


def test_a_spec_file_of_that_kind_katamgr_did_not_write_is_never_overwritten_or_removed(tmp_path):
    host = materialise(find_profile("qemu-standins"), tmp_path / "host")
    theirs = host.path("/var/run/cdi/example.com-edu.yaml")
    theirs.parent.mkdir(parents=True, exist_ok=True)
    theirs.write_text("cdiVersion: 0.5.0\nkind: example.com/edu\ndevices: []\n")
    report = reconcile(host, naming(include=STANDINS), Steps(), None)
    [failure] = [f for f in report.failures if "example.com-edu.yaml" in f]
    assert "katamgr did not write it" in failure
    assert theirs.read_text() == "cdiVersion: 0.5.0\nkind: example.com/edu\ndevices: []\n"
    assert host.path("/var/run/cdi/example.com-vga.yaml").exists()  # its own spec is written
    revert_all(host, Steps(), None)
    assert theirs.exists() and not host.path("/var/run/cdi/example.com-vga.yaml").exists()
