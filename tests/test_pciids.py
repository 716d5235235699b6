"""Model names from pci.ids and the resource names made of them."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from katamgr.host.pciids import PciIds, format_resource_suffix, resource_name, validate_alias

NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?$")


def test_design_examples():
    assert format_resource_suffix("GA102GL [A10]") == "GA102GL_A10"
    assert format_resource_suffix("GH100 [H100 SXM5 80GB]") == "GH100_H100_SXM5_80GB"
    # Debian 12's hwdata has no space before the bracket; the name is the same.
    assert format_resource_suffix("GH100[H100 SXM5 80GB]") == "GH100_H100_SXM5_80GB"
    assert format_resource_suffix("GA100 [A100 PCIe 80GB]") == "GA100_A100_PCIE_80GB"
    assert format_resource_suffix("TU102GL [Quadro RTX 6000/8000]") == "TU102GL_QUADRO_RTX_6000_8000"


def test_system_database_knows_the_a10():
    ids = PciIds.find()
    assert ids.path is not None, "install hwdata (bash .ci/setup)"
    assert ids.device_name(0x10DE, 0x2236) == "GA102GL [A10]"
    assert resource_name(ids, 0x10DE, 0x2236) == "nvidia.com/GA102GL_A10"


def test_vendor_sections_do_not_leak(tmp_path):
    path = tmp_path / "pci.ids"
    path.write_text("# comment\n10de  NVIDIA Corporation\n\t2236  GA102GL [A10]\n\t\t10de 1482  A10 board\n"
                    "8086  Intel\n\t2237  Not NVIDIA\n")
    ids = PciIds(path)
    assert ids.device_name(0x10DE, 0x2236) == "GA102GL [A10]"
    assert ids.device_name(0x10DE, 0x2237) is None
    assert resource_name(ids, 0x10DE, 0x2237) == "nvidia.com/2237"


def test_missing_database_falls_back_to_hex():
    assert resource_name(PciIds(None), 0x10DE, 0x20B5) == "nvidia.com/20B5"


@given(st.text(max_size=300))
def test_any_model_name_gives_a_valid_name_or_nothing(model):
    suffix = format_resource_suffix(model)
    assert suffix == "" or NAME_RE.match(suffix)


@given(st.from_regex(NAME_RE, fullmatch=True))
def test_valid_aliases_are_kept_verbatim(alias):
    assert validate_alias(alias) == alias
