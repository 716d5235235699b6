"""The full passthrough units (Fabric Manager User Guide §6.1, ``gpunode.policy.nvlinkunits``): a
board becomes one unit of all its GPUs and NVSwitches only where the node's Kata cold-plugs
NVSwitches and the board is one §6.1 describes, whole; otherwise the NVSwitches stay units of
their own, as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpunode.host.pciids import PciIds
from gpunode.policy.inventory import discover
from gpunode.policy.katarelease import parse_release
from gpunode.policy.naming import Naming
from gpunode.policy.passthrough import resource_units
from gpunode.policy.selection import NvswitchRule, Selection, parse_exclude
from katamgr.pipeline.devices import apply_host
from katamgr.pipeline.plan import build_plan
from nodesim.materialise import materialise
from nodesim.profile import parse_profile
from nodesim.profiles import SHIPPED

PCI_IDS = PciIds.find()
H100 = "nvidia.com/GH100H100_SXM5_80GB"


def bound(tmp_path: Path, naming: Naming, replace: dict[str, str] | None = None):
    """hgx-h100-passthrough (its device IDs changed by ``replace``) bound as ``naming`` says."""
    text = (SHIPPED / "hgx-h100-passthrough.yaml").read_text()
    for old, new in (replace or {}).items():
        text = text.replace(old, new)
    host = materialise(parse_profile(yaml.safe_load(text)), tmp_path / "host")
    plan = build_plan(host, naming)
    assert apply_host(host, plan).ok
    return plan, resource_units(host, discover(host, naming.selection, naming.nvswitch_rule), naming)


def test_an_hgx_h100_board_on_kata_4_1_is_one_unit_and_its_gpus_one_each(tmp_path):
    naming = Naming(PCI_IDS, nvswitch_rule=NvswitchRule(parse_release("4.1.0")))
    plan, units = bound(tmp_path, naming)
    assert plan.resources == {H100: 8, f"{H100}_x8": 1}
    [board] = [u for u in units if u.resource_name == f"{H100}_x8"]
    assert not [u for u in units if u.head.is_nvswitch]  # an NVSwitch goes to a VM only with the board
    assert board.id == "x8-0000:03:00.0"
    assert [d.bdf for d in board.devices] == sorted(
        f"0000:{b}:00.0" for b in ("03", "04", "05", "13", "14", "15", "83", "84", "85", "93", "94", "95"))
    assert board.nodes == ("/dev/vfio/vfio", *(f"/dev/vfio/{g}" for g in (6, 8, 10, 16, 18, 20, 26, 28, 30, 36, 38, 40)))


@pytest.mark.parametrize(("why", "naming", "replace"), [
    # Kata before 4.1 fails a sandbox given an NVSwitch: no full passthrough model, the operator's opt-in as before.
    ("old Kata", Naming(PCI_IDS, selection=Selection(nvswitches=True), nvswitch_rule=NvswitchRule(parse_release("3.29.0"))), None),
    # A GPU kept on the host: the board is not whole, and no row of §6.1 fits 7 GPUs.
    ("a GPU missing", Naming(PCI_IDS, selection=Selection((), (parse_exclude("0000:94:00.0"),)),
                             nvswitch_rule=NvswitchRule(parse_release("4.1.0"))), None),
    # HGX A100's NVSwitch (10de:1af1), 4 of the 6 its board has: no row of §6.1 fits.
    ("an A100 board short of NVSwitches", Naming(PCI_IDS, nvswitch_rule=NvswitchRule(parse_release("4.1.0"))),
     {"device: 0x22a3": "device: 0x1af1"}),
])
def test_no_board_unit_where_no_configuration_fits(tmp_path, why, naming, replace):
    plan, units = bound(tmp_path, naming, replace)
    assert not [r for r in plan.resources if r.endswith("_x8")], why
    assert not [u for u in units if u.resource_name.endswith("_x8")], why
    assert len([u for u in units if u.head.is_nvswitch]) == 4  # each NVSwitch its own unit, as before
