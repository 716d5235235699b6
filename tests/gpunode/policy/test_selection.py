"""Device selection: which PCI devices are passthrough devices, and why (gpunode.policy.selection),
and how the inventory, naming and the passthrough list follow it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from support.hostkit import AUDIO_A6000, GPU_A6000, NIC_I210, ROOT_PORT, dev, make_host

from gpunode.host import vfio, vfiogroups
from gpunode.host.pci import Device
from gpunode.host.pciids import PciIds
from gpunode.policy import vfiodecide
from gpunode.policy.inventory import Kind, discover
from gpunode.policy.katarelease import parse_release
from gpunode.policy.naming import Naming
from gpunode.policy.passthrough import passthrough_devices, resource_units
from gpunode.policy.selection import (
    DEFAULT_SELECTION,
    FABRIC_KEEPS,
    NvswitchRule,
    Selection,
    parse_exclude,
    parse_include,
    select,
)
from gpunode.services.options import selection_from
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

EDU = {"vendor": 0x1234, "device": 0x11E8, "class": 0x00FF00}
NVSWITCH = {"vendor": 0x10DE, "device": 0x22A3, "class": 0x068000}
PCI_IDS = PciIds.find()


def device(bdf: str, kind: dict) -> Device:
    return Device(bdf, kind["vendor"], kind["device"], kind["class"], None, 1, None)


def rules(*, include=(), exclude=()) -> Selection:
    return Selection(tuple(parse_include(t) for t in include), tuple(parse_exclude(t) for t in exclude))


def test_the_default_selects_nvidia_gpus_and_the_nvswitches_kata_can_take():
    assert select(DEFAULT_SELECTION, device("0000:01:00.0", GPU_A6000)).why == "NVIDIA GPU (default selection)"
    # The node's Kata release unknown: taken as one before 4.1, which fails NVSwitches.
    held = select(DEFAULT_SELECTION, device("0000:05:00.0", NVSWITCH))
    assert not held.selected and not held.excluded
    assert held.why == ("NVIDIA NVSwitch, not passed through: Kata before 4.1 cannot cold-plug one, and "
                        "--kata-version does not say the node runs a later release")
    newer = NvswitchRule(parse_release("4.1.0"))
    switch = device("0000:05:00.0", NVSWITCH)
    assert select(DEFAULT_SELECTION, switch, newer).why == "NVIDIA NVSwitch (Kata 4.1.0 cold-plugs NVSwitches)"
    older = NvswitchRule(parse_release("v3.29"))
    assert select(DEFAULT_SELECTION, switch, older).why == (
        "NVIDIA NVSwitch, not passed through: Kata 3.29.0 cannot cold-plug one")
    opted, old = Selection(nvswitches=True), NvswitchRule(parse_release("3.25.0"))
    assert select(opted, switch, old).why == "NVIDIA NVSwitch (--nvswitches true)"
    assert "a pod given an NVSwitch will not start" in old.nvswitch_warning(opted.nvswitches)
    assert NvswitchRule(parse_release("4.1")).nvswitch_warning(True) is None
    assert not select(Selection(nvswitches=False), switch, NvswitchRule(parse_release("4.1"))).selected
    with pytest.raises(ValueError, match="'3.x' is not a Kata release"):
        parse_release("3.x")
    for other in (AUDIO_A6000, NIC_I210, EDU, ROOT_PORT):
        verdict = select(DEFAULT_SELECTION, device("0000:02:00.0", other))
        assert not verdict.selected and not verdict.excluded


def test_include_names_the_resource_and_exclude_wins():
    edu = device("0000:01:00.0", EDU)
    included = select(rules(include=["1234:11E8=example.com/edu"]), edu)
    assert included.selected and included.resource == "example.com/edu"
    assert included.why == "included by --include-device 1234:11e8 as example.com/edu"
    both = select(rules(include=["1234:11e8=example.com/edu"], exclude=["0000:01:00.0"]), edu)
    assert not both.selected and both.excluded
    assert both.why == "excluded by --exclude-device 0000:01:00.0"
    # By ids, case-insensitive, only that device.
    by_ids = rules(exclude=["10DE:2230"])
    assert select(by_ids, device("0000:01:00.0", GPU_A6000)).why == "excluded by --exclude-device 10de:2230"
    assert select(dataclasses.replace(by_ids, nvswitches=True), device("0000:05:00.0", NVSWITCH)).selected


@pytest.mark.parametrize("flag, value, message", [
    ("--include-device", "1234:11e8", "'1234:11e8' is not VENDOR:DEVICE=RESOURCE"),
    ("--include-device", "1234:11e8=", "'1234:11e8=' is not VENDOR:DEVICE=RESOURCE"),
    ("--include-device", "1234:11g8=example.com/edu", "'1234:11g8' is not a PCI vendor:device pair"),
    ("--include-device", "123:11e8=example.com/edu", "'123:11e8' is not a PCI vendor:device pair"),
    ("--include-device", "1234:11e8=edu", "'edu' is not an extended resource name"),
    ("--include-device", "1234:11e8=kubernetes.io/edu", "'kubernetes.io/edu' is not an extended resource"),
    ("--include-device", "1234:11e8=Example.com/edu", "'Example.com/edu' is not an extended resource"),
    ("--include-device", "1234:11e8=example.com/_edu", "'example.com/_edu' is not an extended resource"),
    ("--include-device", "1234:11e8=example.com/3d", "'example.com/3d' is not usable as a CDI kind"),
    ("--exclude-device", "01:00.0", "'01:00.0' is not a full PCI address such as 0000:01:00.0 "
                                    "(with its domain: 0000:01:00.0)"),
    ("--exclude-device", "0000:01:00.8", "'0000:01:00.8' is not a full PCI address"),
    ("--exclude-device", "nvidia", "'nvidia' is neither a full PCI address"),
    ("--exclude-device", "10de:1eb", "'10de:1eb' is not a PCI vendor:device pair"),
])
def test_a_bad_value_is_refused_naming_the_option_and_the_value(flag, value, message):
    args = argparse.Namespace(include_device=[], exclude_device=[])
    getattr(args, flag[2:].replace("-", "_")).append(value)
    with pytest.raises(ValueError) as refused:
        selection_from(args)
    assert str(refused.value).startswith(f"{flag}: ")
    assert message in str(refused.value)


def test_flags_add_to_the_config_and_one_device_cannot_get_two_resources():
    config = Selection((parse_include("1234:11e8=example.com/edu", "config devices.include"),))
    args = argparse.Namespace(include_device=["1234:1111=example.com/vga", "1234:11e8=example.com/edu"],
                              exclude_device=["0000:00:01.0"])
    merged = selection_from(args, config)
    assert [str(r) for r in merged.include] == ["1234:11e8=example.com/edu", "1234:1111=example.com/vga"]
    assert merged.include[0].origin == "config devices.include"
    args.include_device = ["1234:11e8=example.com/other"]
    with pytest.raises(ValueError, match="1234:11e8=example.com/other and config devices.include "
                                         "1234:11e8=example.com/edu include 1234:11e8 under two"):
        selection_from(args, config)


def test_the_nvswitch_decision_follows_the_nodes_rule_not_the_operators_selection(tmp_path):
    """One operator selection on one NVSwitch board: the Kata release the node runs and its
    NVLink fabric model (the node context's ``NvswitchRule``) decide whether its NVSwitches are
    scanned, named and listed as passthrough devices; the ``Selection`` holds no node fact."""
    assert {f.name for f in dataclasses.fields(Selection)} == {"include", "exclude", "nvswitches"}
    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    old, new = NvswitchRule(parse_release("3.29.0")), NvswitchRule(parse_release("4.1.0"))
    # Kata 4.1 cold-plugs NVSwitches, but Fabric Manager on the host keeps them (Shared NVSwitch).
    kept = NvswitchRule(parse_release("4.1.0"), fabric_keeps_nvswitches=True)
    switches = [d.bdf for d in discover(host).devices if d.is_nvswitch]
    assert len(switches) == 4

    def passed(selection: Selection, rule: NvswitchRule) -> list[str]:
        inv = discover(host, selection, rule)
        naming = Naming(PCI_IDS, selection=selection, nvswitch_rule=rule)
        named = [d.bdf for d in inv.devices if d.is_nvswitch and naming.resource(d) is not None]
        assert named == [d.bdf for d in inv.nvswitches]  # the scan and the names agree
        return named

    assert passed(DEFAULT_SELECTION, old) == [] and passed(DEFAULT_SELECTION, kept) == []
    assert passed(DEFAULT_SELECTION, new) == switches
    first = discover(host, DEFAULT_SELECTION, kept).by_bdf[switches[0]]
    assert discover(host, DEFAULT_SELECTION, kept).why(first) == f"NVIDIA NVSwitch, {FABRIC_KEEPS}"
    # The operator's true passes them on every node; the rule says what that costs there.
    opted = Selection(nvswitches=True)
    assert passed(opted, old) == passed(opted, kept) == switches
    assert "a pod given an NVSwitch will not start" in old.nvswitch_warning(opted.nvswitches)
    assert "no GPU partition can be activated" in kept.nvswitch_fabric_conflict(opted.nvswitches)
    assert new.nvswitch_warning(True) is None and new.nvswitch_fabric_conflict(True) is None
    assert passed(Selection(nvswitches=False), new) == []


def workstation(tmp_path):
    """A display GPU (with its audio function) and a second GPU, each in its own group."""
    return make_host(tmp_path, [
        dev("0000:00:01.0", ROOT_PORT, "pcieport", 1),
        dev("0000:01:00.0", GPU_A6000, "nvidia", 15, parent="0000:00:01.0", minor=0),
        dev("0000:01:00.1", AUDIO_A6000, "snd_hda_intel", 15, parent="0000:00:01.0"),
        dev("0000:02:00.0", GPU_A6000, "nvidia", 16, minor=1),
        dev("0000:03:00.0", NIC_I210, "igb", 17),
    ])


def test_inventory_follows_the_selection(tmp_path):
    host = workstation(tmp_path)
    default = discover(host)
    assert [d.bdf for d in default.passthrough] == ["0000:01:00.0", "0000:02:00.0"]
    assert default.companions == {"0000:01:00.1": "0000:01:00.0"}

    display_out = discover(host, rules(exclude=["0000:01:00.0"]))
    gpu, audio = display_out.by_bdf["0000:01:00.0"], display_out.by_bdf["0000:01:00.1"]
    assert [d.bdf for d in display_out.passthrough] == ["0000:02:00.0"]
    assert display_out.kind(gpu) is Kind.EXCLUDED and display_out.why(gpu) == (
        "excluded by --exclude-device 0000:01:00.0")
    # Its audio function travels with no passthrough device now: it is nobody's companion.
    assert display_out.kind(audio) is Kind.OTHER and display_out.companions == {}
    assert [d.bdf for d in display_out.ours] == ["0000:02:00.0"]

    audio_out = discover(host, rules(exclude=["0000:01:00.1"]))
    assert audio_out.kind(audio_out.by_bdf["0000:01:00.1"]) is Kind.EXCLUDED
    assert [d.bdf for d in audio_out.foreign(15)] == ["0000:01:00.1"]

    nic_in = discover(host, rules(include=["8086:1533=example.com/nic"]))
    assert nic_in.kind(nic_in.by_bdf["0000:03:00.0"]) is Kind.INCLUDED
    assert nic_in.why(nic_in.by_bdf["0000:01:00.1"]) == "companion of 0000:01:00.0 (same slot and IOMMU group)"


def test_naming_follows_the_selection():
    selection = dataclasses.replace(rules(include=["1234:11e8=example.com/edu"], exclude=["10de:2230"]),
                                    nvswitches=True)
    naming = Naming(PCI_IDS, gpu_alias="pgpu", selection=selection)
    assert naming.resource(device("0000:01:00.0", EDU)) == "example.com/edu"
    assert naming.resource(device("0000:02:00.0", GPU_A6000)) is None  # excluded: never advertised
    assert naming.resource(device("0000:05:00.0", NVSWITCH)) is not None
    # An include rule's name is used as given, whatever the aliases say; for a GPU too.
    gpu_in = Naming(PCI_IDS, gpu_alias="pgpu", selection=rules(include=["10de:2230=example.com/a6000"]))
    assert gpu_in.resource(device("0000:02:00.0", GPU_A6000)) == "example.com/a6000"


def test_included_devices_are_units_of_their_resource_without_index_names(tmp_path):
    host = materialise(find_profile("qemu-standins"), tmp_path / "host")
    selection = rules(include=["1234:11e8=example.com/edu", "1234:1111=example.com/vga"],
                      exclude=["0000:00:01.0"])
    assert not vfio.bind(host, vfiodecide.decide(host, discover(host, selection))).failures
    inv = discover(host, selection)
    named, _notes = passthrough_devices(host, inv)
    assert named == []  # nvidia.com/pgpu index names are for GPUs
    units = resource_units(host, inv, Naming(PCI_IDS, selection=selection))
    assert [(u.id, u.resource_name, u.group, u.members) for u in units] == [
        ("0000:01:00.0", "example.com/edu", 3, ()), ("0000:02:00.0", "example.com/vga", 5, ())]
    assert units[0].cdi_name == "example.com/edu=0000:01:00.0"
    with pytest.raises(ValueError, match="different device selections"):
        resource_units(host, inv, Naming(PCI_IDS))


def test_an_excluded_gpu_gets_no_index_name(tmp_path):
    host = workstation(tmp_path)
    assert not vfio.bind(host, vfiodecide.decide(host, discover(host))).failures  # every GPU on vfio-pci
    named, _ = passthrough_devices(host, discover(host, rules(exclude=["0000:01:00.0"])))
    assert [(d.device.bdf, d.index) for d in named] == [("0000:02:00.0", 0)]


def test_an_included_device_takes_no_slot_mates_along(tmp_path):
    """A chipset's SMBus function shares its slot and IOMMU group with the LPC bridge
    and the SATA controller (the host's disk): including it must not move them."""
    host = materialise(find_profile("qemu-standins"), tmp_path / "host")
    inv = discover(host, rules(include=["8086:2930=example.com/smbus"]))
    assert inv.companions == {}
    assert [d.bdf for d in inv.ours] == ["0000:00:1f.3"]
    [decision] = [d for d in vfiodecide.decide(host, inv) if d.group == inv.by_bdf["0000:00:1f.3"].iommu_group]
    assert decision.action is vfiogroups.Action.SKIP
    assert "0000:00:1f.2 (8086:2922, driver ahci)" in decision.reason


@pytest.mark.parametrize("taken", ["nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-1g.10gb",
                                   "nvidia.com/pgpu", "nvidia.com/nvswitch"])
def test_an_include_rule_may_not_take_a_reserved_resource(taken):
    with pytest.raises(ValueError, match=f"'{taken}' is taken"):
        parse_include(f"1234:11e8={taken}")
