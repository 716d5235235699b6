"""The GPU labels of each shipped profile, checked against GFD's naming and NFD's NVIDIA rules.

GFD's rules (NVIDIA/k8s-device-plugin ``internal/lm/resource.go``): the product is NVML's
name with every character outside ``[A-Za-z0-9-_. ]`` dropped and each run of spaces one
``-``; the family follows the CUDA compute capability; the memory is in MiB. NFD's NVIDIA
rules and kata-deploy's are data in ``tests/data/nfd`` (their source in its README).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from gpunode.host import cc
from gpunode.host.pci import scan
from gpunode.host.pciids import PciIds
from gpunode.k8snames import label_value_problem
from gpunode.policy.gpulabels import (
    CC_CAPABLE,
    COUNT,
    FAMILY,
    KEYS,
    MEMORY,
    PRODUCT,
    family_of,
    node_gpu_labels,
    sanitise,
)
from gpunode.policy.inventory import discover
from katamgr.config import default_config
from nodesim.materialise import materialise
from nodesim.profile import parse_profile
from nodesim.profiles import find_profile, shipped_names

DATA = Path(__file__).resolve().parents[2] / "data"
PCI_IDS = PciIds.find(DATA / "pciids" / "pci.ids")

# What each shipped profile is labelled, by GFD's names (the nvidia-smi names and memory as the
# table in gpunode.policy.gpulabels cites them).
EXPECTED = {
    "dgx-h100": {PRODUCT: "NVIDIA-H100-80GB-HBM3", FAMILY: "hopper", COUNT: "8", MEMORY: "81559",
                 CC_CAPABLE: "true"},
    # The same board in the full passthrough model (Kata 4.1, no Fabric Manager on the host).
    "hgx-h100-passthrough": {PRODUCT: "NVIDIA-H100-80GB-HBM3", FAMILY: "hopper", COUNT: "8", MEMORY: "81559",
                             CC_CAPABLE: "true"},
    "a10-server": {PRODUCT: "NVIDIA-A10", FAMILY: "ampere", COUNT: "4", MEMORY: "23028"},
    "no-iommu-t4": {PRODUCT: "Tesla-T4", FAMILY: "turing", COUNT: "2", MEMORY: "15360"},
    "workstation-a6000": {PRODUCT: "NVIDIA-RTX-A6000", FAMILY: "ampere", COUNT: "1", MEMORY: "49140"},
    # NVML names it "NVIDIA GH200 480GB" or "... 120GB": pci.ids' name; no SEV-SNP/TDX: no cc.capable.
    "gh200": {PRODUCT: "NVIDIA-GH200-120GB-480GB", FAMILY: "hopper", COUNT: "1", MEMORY: "97871"},
    "qemu-standins": {},
}
# GFD's getArchFamily values.
GFD_FAMILIES = {"tesla", "fermi", "kepler", "maxwell", "pascal", "volta", "turing", "ampere", "ada-lovelace",
                "hopper", "blackwell", "rubin", "undefined"}
GFD_PRODUCT = re.compile(r"^[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*$")


def labels_of(tmp_path, profile, pci_ids=PCI_IDS):
    host = materialise(find_profile(profile) if isinstance(profile, str) else profile, tmp_path / "host")
    return host, node_gpu_labels(host, discover(host), pci_ids)


def test_every_shipped_profile_is_in_the_table():
    assert set(EXPECTED) == set(shipped_names())


@pytest.mark.parametrize("profile", sorted(EXPECTED))
def test_each_profile_gets_gfds_labels(tmp_path, profile):
    host, found = labels_of(tmp_path, profile)
    assert found.labels == EXPECTED[profile]
    assert set(found.labels) <= set(KEYS)
    # GFD's naming: each value what GFD would print, each a valid label value, each sourced.
    for key, value in found.labels.items():
        assert label_value_problem(value) is None, (key, value)
        assert found.sources.get(key), key
    if PRODUCT in found.labels:
        assert GFD_PRODUCT.match(found.labels[PRODUCT])
        assert sanitise(found.labels[PRODUCT]) == found.labels[PRODUCT]
    if FAMILY in found.labels:
        assert found.labels[FAMILY] in GFD_FAMILIES
    for key in (COUNT, MEMORY):
        if key in found.labels:
            assert found.labels[key].isdigit()
    # gpu.count: every NVIDIA GPU, whatever its driver.
    gpus = [d for d in scan(host) if d.is_gpu]
    assert found.labels.get(COUNT, "0") == str(len(gpus))


def test_the_labels_do_not_depend_on_the_pci_ids_spelling(tmp_path):
    # Debian 12's pci.ids spells the H100 "GH100[H100 SXM5 80GB]"; our table names it.
    _, found = labels_of(tmp_path, "dgx-h100", PciIds(None))
    assert found.labels == EXPECTED["dgx-h100"]


def test_gfds_product_rule():
    assert sanitise("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3"
    assert sanitise("Tesla T4") == "Tesla-T4"
    assert sanitise("NVIDIA A100-SXM4-40GB") == "NVIDIA-A100-SXM4-40GB"
    assert sanitise("NVIDIA  GH200 (120GB / 480GB)") == "NVIDIA-GH200-120GB-480GB"


@pytest.mark.parametrize(("compute", "family"), [
    ((7, 0), "volta"), ((7, 5), "turing"), ((8, 0), "ampere"), ((8, 6), "ampere"), ((8, 9), "ada-lovelace"),
    ((9, 0), "hopper"), ((10, 0), "blackwell"), ((12, 0), "blackwell"), ((11, 0), "undefined")])
def test_gfds_family_rule(compute, family):
    assert family_of(compute) == family


def _gpus_profile(*gpus: tuple[str, int]) -> object:
    devices = [{"bdf": "0000:00:00.0", "vendor": 0x8086, "device": 0x09A2, "class": 0x060000}]
    for bdf, device in gpus:
        devices.append({"bdf": bdf, "vendor": 0x10DE, "device": device, "class": 0x030200, "driver": "nvidia",
                        "iommu_group": int(bdf[5:7], 16)})
    return parse_profile({"name": "mixed", "iommu": True, "devices": devices})


def test_several_models_are_labelled_as_gfd_does_with_one_models_labels(tmp_path):
    # GFD: one labeler per model, merged in map order, count per model. Ours: the model with the
    # most GPUs.
    profile = _gpus_profile(("0000:01:00.0", 0x1EB8), ("0000:02:00.0", 0x2236), ("0000:03:00.0", 0x2236))
    _, found = labels_of(tmp_path, profile)
    assert found.labels == {PRODUCT: "NVIDIA-A10", FAMILY: "ampere", COUNT: "2", MEMORY: "23028"}
    assert "GPUs of 2 models" in found.notes[0]


def test_a_tie_goes_to_the_first_gpu_in_bus_order(tmp_path):
    profile = _gpus_profile(("0000:01:00.0", 0x1EB8), ("0000:02:00.0", 0x2236))
    _, found = labels_of(tmp_path, profile)
    assert found.labels[PRODUCT] == "Tesla-T4" and found.labels[COUNT] == "1"


def test_a_gpu_not_in_the_table_is_named_by_pci_ids_and_its_family_by_nvidias_tool(tmp_path):
    # 10de:2901 (B200): pci.ids "GB100 [B200]", gpu-admin-tools knows it as blackwell; no memory.
    _, found = labels_of(tmp_path, _gpus_profile(("0000:01:00.0", 0x2901)))
    assert found.labels == {PRODUCT: "NVIDIA-B200", FAMILY: "blackwell", COUNT: "1"}
    # 10de:27b8 (L4): "AD104GL [L4]": ada-lovelace from the chip.
    _, found = labels_of(tmp_path / "l4", _gpus_profile(("0000:01:00.0", 0x27B8)))
    assert found.labels == {PRODUCT: "NVIDIA-L4", FAMILY: "ada-lovelace", COUNT: "1"}
    assert "pci.ids chip AD104GL" in found.sources[FAMILY]


# ---- NFD's NVIDIA rules and kata-deploy's ------------------------------------------------


def _expression_holds(op: str, values: list | None, value: str | None) -> bool:
    if op == "Exists":
        return value is not None
    if op == "IsTrue":
        return value == "true"
    if op == "In":
        return value in [str(v) for v in values or []]
    raise AssertionError(f"op {op} not taught to this evaluator")


def nfd_labels(rules: list[dict], host) -> dict[str, str]:
    """What NFD would label the node with: the rules' subset of NFD's matching (pci.device
    vendor/device, cpu.security from the host's KVM, rule.matched), in order."""
    devices = [{"vendor": f"{d.vendor:04x}", "device": f"{d.device:04x}"} for d in scan(host)]
    kvm = cc.host_cc(host)
    cpu = {"sev.snp.enabled": "true" if kvm == "sev-snp" else None, "tdx.enabled": "true" if kvm == "tdx" else None}
    matched: dict[str, str] = {}

    def feature_holds(term: dict) -> bool:
        exprs = term["matchExpressions"]
        if term["feature"] == "pci.device":
            return any(all(_expression_holds(e["op"], e.get("value"), dev.get(k)) for k, e in exprs.items())
                       for dev in devices)
        source = cpu if term["feature"] == "cpu.security" else matched
        return all(_expression_holds(e["op"], e.get("value"), source.get(k)) for k, e in exprs.items())

    for rule in rules:
        alternatives = [rule["matchFeatures"]] if "matchFeatures" in rule else \
            [a["matchFeatures"] for a in rule["matchAny"]]
        if any(all(feature_holds(t) for t in terms) for terms in alternatives):
            matched.update({k: str(v) for k, v in rule.get("labels", {}).items()})
    return matched


@pytest.mark.parametrize("profile", sorted(EXPECTED))
def test_our_labels_agree_with_the_gpu_operators_nfd_rules(tmp_path, profile):
    rules = yaml.safe_load((DATA / "nfd" / "gpu-operator-nvidia-rules.yaml").read_text())["spec"]["rules"]
    host, found = labels_of(tmp_path, profile)
    theirs = {k: v for k, v in nfd_labels(rules, host).items() if k in KEYS}
    # Every GPU label NFD's rules would set, we set with the same value.
    assert {k: found.labels.get(k) for k in theirs} == theirs
    if profile == "dgx-h100":
        assert theirs == {FAMILY: "hopper", CC_CAPABLE: "true"}


def test_kata_deploys_rules_select_our_nodes_without_nfds_gpu_labels(tmp_path):
    data = yaml.safe_load((DATA / "nfd" / "kata-deploy-4.1.0.yaml").read_text())
    for rule_object in data["nodeFeatureRules"]:
        for rule in rule_object["spec"]["rules"]:
            for term in rule["matchFeatures"]:
                # No rule matches a GPU label or a PCI device: a node is selected by its CPU alone.
                assert term["feature"] == "cpu.security"
    host, found = labels_of(tmp_path, "dgx-h100")
    rules = [r for o in data["nodeFeatureRules"] for r in o["spec"]["rules"]]
    assert nfd_labels(rules, host) == {"amd.feature.node.kubernetes.io/snp": "true"}
    # Its GPU classes' nodeSelectors name, of NVIDIA's labels, only cc.ready.state (the CC room's).
    nvidia_keys = {k for sel in data["runtimeClassNodeSelectors"].values() for k in sel if k.startswith("nvidia.com/")}
    assert nvidia_keys == {cc.READY_STATE_LABEL}


def test_our_confidential_class_selects_the_node_by_the_published_cc_capable(tmp_path):
    snp = next(c for c in default_config().runtime_classes if c.name.endswith("-snp"))
    for profile, selected in (("dgx-h100", True), ("gh200", False), ("a10-server", False)):
        _, found = labels_of(tmp_path / profile, profile)
        assert all(found.labels.get(k) == v for k, v in snp.node_selector.items()) is selected, profile
