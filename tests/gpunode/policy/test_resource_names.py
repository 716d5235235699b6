"""Model names from pci.ids and the resource names made of them.

The default rule must match NVIDIA's sandbox device plugin byte for byte, so a
pod written for a GPU Operator node schedules here. The rule as NVIDIA's plugin
applies it (Go, on the trimmed pci.ids device name): ``strings.ToUpper``;
``strings.Replace`` of ``/`` and of ``.`` by ``_``; ``regexp \\s+`` -> ``_`` (RE2's
``\\s`` is ASCII whitespace); ``regexp [^a-zA-Z0-9_-]`` -> ``""``; with no pci.ids
entry, the device id as ``%04x``. ``nvidia_rule`` below transcribes those steps
one by one, independently of ``gpunode.policy.naming``.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

import cdi
from gpunode.host.pciids import PciIds
from gpunode.policy.naming import (
    ResourceNaming,
    compact_suffix,
    derive_resource_name,
    nvidia_suffix,
    resource_name,
    validate_alias,
)

# A Kubernetes extended resource name's part after the slash.
EXTENDED_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
GO_SPACE = " \t\n\f\r"


def nvidia_rule(model: str) -> str:
    upper = "".join(c.upper() if len(c.upper()) == 1 else c for c in model)  # Go maps rune to rune
    replaced = upper.replace("/", "_").replace(".", "_")
    out, in_space = [], False
    for c in replaced:
        if c in GO_SPACE:
            if not in_space:
                out.append("_")
            in_space = True
            continue
        in_space = False
        out.append(c)
    return "".join(c for c in out if c.isascii() and (c.isalnum() or c in "_-"))


def usable(name: str) -> bool:
    """A valid extended resource name that is also a CDI kind (what Kata resolves)."""
    vendor, _, suffix = name.partition("/")
    if not EXTENDED_NAME.match(suffix):
        return False
    try:
        cdi.parse_kind(name)
    except cdi.InvalidNameError:
        return False
    return True


def test_nvidia_examples():
    assert nvidia_suffix("GA102GL [A10]") == "GA102GL_A10"
    assert nvidia_suffix("GA107GL [A2 / A16]") == "GA107GL_A2___A16"
    assert nvidia_suffix("GH100 [H100 SXM5 80GB]") == "GH100_H100_SXM5_80GB"
    # Debian 12's hwdata has no space before the bracket: NVIDIA's rule runs the words together.
    assert nvidia_suffix("GH100[H100 SXM5 80GB]") == "GH100H100_SXM5_80GB"
    assert nvidia_suffix("TU102GL [Quadro RTX 6000/8000]") == "TU102GL_QUADRO_RTX_6000_8000"
    assert nvidia_suffix("GA100 [A100 PCIe 80GB]") == "GA100_A100_PCIE_80GB"


def test_compact_examples():
    assert compact_suffix("GA107GL [A2 / A16]") == "GA107GL_A2_A16"
    assert compact_suffix("GH100[H100 SXM5 80GB]") == "GH100_H100_SXM5_80GB"
    assert compact_suffix("GA102GL [A10]") == "GA102GL_A10"


def test_go_semantics_at_the_edges():
    # No-break space is no RE2 \s: dropped, not "_"; "ß" has no one-rune upper case in Go.
    assert nvidia_suffix("A\u00a0B") == "AB"
    assert nvidia_suffix("straße") == "STRAE"
    assert nvidia_suffix("a.b/c  d") == "A_B_C_D"


def test_system_database_knows_the_a10():
    ids = PciIds.find()
    assert ids.path is not None, "install hwdata (bash .ci/setup)"
    assert ids.device_name(0x10DE, 0x2236) == "GA102GL [A10]"
    assert resource_name(ids, 0x10DE, 0x2236) == "nvidia.com/GA102GL_A10"


def nvidia_entries(ids: PciIds) -> dict[int, str]:
    ids.device_name(0x10DE, 0)  # loads the vendor
    return ids._names[0x10DE]


def test_every_nvidia_entry_of_the_system_pci_ids_is_named_as_nvidia_names_it():
    ids = PciIds.find()
    assert ids.path is not None, "install hwdata (bash .ci/setup)"
    entries = nvidia_entries(ids)
    assert len(entries) > 1000
    adjusted = []
    for device, model in entries.items():
        theirs = f"nvidia.com/{nvidia_rule(model) or f'{device:04x}'}"
        derived = derive_resource_name(ids, 0x10DE, device)
        assert derived.rule_result == theirs, model
        if usable(theirs):
            assert derived.name == theirs and not derived.adjustments, model
        else:
            adjusted.append(model)
            assert derived.adjustments and usable(derived.name), model
    # The variant is the exception, not the rule.
    assert len(adjusted) < len(entries) / 20


def test_the_compact_rule_differs_where_underscores_repeat():
    ids = PciIds.find()
    entries = nvidia_entries(ids)
    different = [m for m in entries.values() if "__" in nvidia_rule(m)]
    assert different, "expected pci.ids names with ' / ' in them"
    for model in different:
        assert "__" not in compact_suffix(model)


def test_vendor_sections_do_not_leak(tmp_path):
    path = tmp_path / "pci.ids"
    path.write_text("# comment\n10de  NVIDIA Corporation\n\t2236  GA102GL [A10]\n\t\t10de 1482  A10 board\n"
                    "8086  Intel\n\t2237  Not NVIDIA\n")
    ids = PciIds(path)
    assert ids.device_name(0x10DE, 0x2236) == "GA102GL [A10]"
    assert ids.device_name(0x10DE, 0x2237) is None


def test_no_entry_gives_nvidias_lower_case_hex_made_a_cdi_kind():
    derived = derive_resource_name(PciIds(None), 0x10DE, 0x22A3)
    assert derived.rule_result == "nvidia.com/22a3"  # NVIDIA's name
    assert derived.name == "nvidia.com/PCI_22a3"  # a CDI class starts with a letter
    assert "CDI kind" in derived.adjustments[0]
    assert derive_resource_name(PciIds(None), 0x10DE, 0xAB12).name == "nvidia.com/ab12"
    compact = derive_resource_name(PciIds(None), 0x10DE, 0xAB12, ResourceNaming.COMPACT)
    assert compact.name == "nvidia.com/AB12"


def test_long_and_badly_ending_names_get_a_stable_valid_variant(tmp_path):
    path = tmp_path / "pci.ids"
    long_a = "GX" + " WORD" * 20 + " A"
    long_b = "GX" + " WORD" * 20 + " B"
    path.write_text(f"10de  NVIDIA\n\t0001  {long_a}\n\t0002  {long_b}\n\t0003  GZ100 [Z]-\n")
    ids = PciIds(path)
    a, b = (derive_resource_name(ids, 0x10DE, d) for d in (1, 2))
    assert usable(a.name) and usable(b.name) and a.name != b.name
    assert a.name == derive_resource_name(PciIds(path), 0x10DE, 1).name  # deterministic
    assert any("over the 63" in why for why in a.adjustments)
    trailing = derive_resource_name(ids, 0x10DE, 3)
    assert trailing.rule_result == "nvidia.com/GZ100_Z-" and trailing.name == "nvidia.com/GZ100_Z"


@given(st.text(max_size=300), st.sampled_from(list(ResourceNaming)))
def test_any_model_name_gives_a_usable_name(model, rule):
    ids = PciIds(None)
    ids._names[0x10DE] = {0x1234: model}
    assert usable(derive_resource_name(ids, 0x10DE, 0x1234, rule).name)


@given(st.from_regex(r"^[A-Za-z]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?$", fullmatch=True)
       .filter(lambda a: a.lower() != "gpu" and not a.lower().startswith("mig-")))
def test_valid_aliases_are_kept_verbatim(alias):
    assert validate_alias(alias) == alias
    assert usable(f"nvidia.com/{alias}")


@pytest.mark.parametrize("alias", ["", "1gpu", "gpu_", "a/b", "x" * 64])
def test_aliases_that_cannot_be_a_cdi_kind_are_refused(alias):
    with pytest.raises(ValueError, match="alias"):
        validate_alias(alias)


@pytest.mark.parametrize(("alias", "taken"), [
    ("gpu", "nvidia.com/gpu"), ("GPU", "nvidia.com/gpu"),
    ("mig-1g", "nvidia.com/mig-*"), ("mig-1g_10gb", "nvidia.com/mig-*"), ("MIG-3g", "nvidia.com/mig-*")])
def test_an_alias_that_is_a_container_gpu_name_is_refused(alias, taken):
    """nvidia.com/gpu and nvidia.com/mig-* are what NVIDIA's container plugin advertises; both
    admission layers let a runc container have them. A passthrough GPU under such a name would
    be handed to a runc container as /dev/vfio/*."""
    with pytest.raises(ValueError) as refused:
        validate_alias(alias)
    message = str(refused.value)
    assert repr(alias) in message and taken in message and "another alias" in message


@pytest.mark.parametrize("alias", ["pgpu", "gpus", "gpu-passthrough", "nvswitch", "migrated", "mig"])
def test_aliases_beside_the_container_names_are_kept(alias):
    assert validate_alias(alias) == alias
