"""The split of a node's GPUs between Kata VMs and containers (gpunode.policy.split): the label's
grammar, whole IOMMU groups, NVSwitches kept with the container share, and the selection the
agent and the passthrough plugin follow."""

from __future__ import annotations

import pytest

from gpunode.errors import ConfigError
from gpunode.host.pci import Device
from gpunode.policy.selection import DEFAULT_SELECTION, select
from gpunode.policy.split import (
    SPLIT_LABEL,
    SplitPool,
    check_value,
    moves,
    selection_for,
    split,
    split_value,
)

H100, A100 = 0x2330, 0x20B2


def gpu(bus: int, group: int, device: int = H100) -> Device:
    return Device(f"0000:{bus:02x}:00.0", 0x10DE, device, 0x030200, "nvidia", group, None)


def nvswitch(bus: int) -> Device:
    return Device(f"0000:{bus:02x}:00.0", 0x10DE, 0x22A3, 0x068000, "nvidia-nvswitch", 100 + bus, None)


EIGHT = tuple(gpu(0x10 * (i + 1), i) for i in range(8))


def bdfs(devices) -> list[str]:
    return [d.bdf for d in devices]


def test_no_label_gives_every_gpu_to_vms():
    share = split(EIGHT, None)
    assert share.vm == EIGHT and share.container == () and not share.is_split
    assert split(EIGHT, "").vm == EIGHT


def test_a_count_takes_the_last_gpus_so_containers_keep_index_0():
    share = split(EIGHT, "2")
    assert bdfs(share.vm) == ["0000:70:00.0", "0000:80:00.0"]
    assert bdfs(share.container) == [d.bdf for d in EIGHT[:6]]
    assert share.describe().startswith("2 for VMs (0000:70:00.0, 0000:80:00.0), 6 for containers")
    assert split(EIGHT, "0").vm == () and split(EIGHT, "all").container == ()


@pytest.mark.parametrize("value, indices", [
    ("index.6_7", [6, 7]), ("index.4-7", [4, 5, 6, 7]), ("index.0_3-4", [0, 3, 4]),
    ("pci.10-00.0_0000-80-00.0", [0, 7]), ("PCI.10-00.0", [0]),
])
def test_selectors_by_index_and_pci_address(value, indices):
    assert split(EIGHT, value).vm == tuple(EIGHT[i] for i in indices)


def test_a_model_by_device_id_or_gpu_product_name():
    mixed = (gpu(0x10, 1), gpu(0x20, 2, A100), gpu(0x30, 3, A100))
    assert bdfs(split(mixed, "model.20b2").vm) == ["0000:20:00.0", "0000:30:00.0"]
    products = {"0000:10:00.0": "NVIDIA-H100-80GB-HBM3"}
    assert bdfs(split(mixed, "model.NVIDIA-H100-80GB-HBM3", products=products).vm) == ["0000:10:00.0"]


def test_an_iommu_group_goes_to_one_side_whole():
    # Two GPUs behind one PCIe switch without ACS share a group: a VM takes both or neither.
    shared = (gpu(0x10, 1), gpu(0x20, 2), gpu(0x30, 2))
    assert bdfs(split(shared, "2").vm) == ["0000:20:00.0", "0000:30:00.0"]
    with pytest.raises(ConfigError) as exc:
        split(shared, "1")
    assert str(exc.value).startswith(f"{SPLIT_LABEL}='1' cannot be met in whole IOMMU groups: the last "
                                     "groups hold 2 GPUs (0000:20:00.0, 0000:30:00.0)")
    with pytest.raises(ConfigError, match=r"splits IOMMU group 2: it names 0000:30:00.0 but not 0000:20:00.0"):
        split(shared, "index.2")


@pytest.mark.parametrize("value, why", [
    ("9", "asks for 9 GPUs but the node has 8"),
    ("index.8", "names index 8, but the node's GPUs are indices 0 to 7"),
    ("index.7-4", "has the range '7-4', which runs backwards"),
    ("index.a", "has index item 'a', which is not a number"),
    ("pci.c1-00.0", "names 0000:c1:00.0, which is not one of the node's GPUs"),
    ("pci.0000:c1:00.0", "is not a Kubernetes label value"),
    ("model.1eb8", "names model '1eb8', which none of the node's GPUs is (its models: 2330)"),
    ("half", "is neither a count nor a selector"),
    ("2,3", "is not a Kubernetes label value"),
])
def test_a_bad_value_names_itself_and_the_fix(value, why):
    with pytest.raises(ConfigError) as exc:
        split(EIGHT, value)
    message = str(exc.value)
    assert message.startswith(f"{SPLIT_LABEL}={value!r} {why}")
    assert "set it to a count or a selector (2, all, index.6_7" in message
    assert message.endswith("or remove it to give every GPU to VMs")


def test_nvswitches_go_to_vms_only_with_every_gpu():
    switches = (nvswitch(0xA0), nvswitch(0xB0))
    whole = split(EIGHT, "all", nvswitches=switches)
    assert whole.nvswitches_to_vm and whole.notes == ()
    part = split(EIGHT, "2", nvswitches=switches)
    assert not part.nvswitches_to_vm
    assert "stay on the host for the container GPUs' NVLink fabric" in part.notes[0]
    # The selection then keeps them off vfio-pci, however the node's Kata would take them.
    chosen = selection_for(DEFAULT_SELECTION, part)
    assert not select(chosen, switches[0]).selected


def test_the_selection_excludes_the_container_share_by_pci_address():
    share = split(EIGHT, "index.6_7")
    chosen = selection_for(DEFAULT_SELECTION, share)
    assert [select(chosen, d).selected for d in EIGHT] == [False] * 6 + [True] * 2
    assert select(chosen, EIGHT[0]).why == f"excluded by the split label {SPLIT_LABEL} 0000:10:00.0"
    assert selection_for(DEFAULT_SELECTION, split(EIGHT, None)) is DEFAULT_SELECTION


def test_moves_name_only_the_gpus_that_change_side():
    change = moves(split(EIGHT, "2"), split(EIGHT, "3"))
    assert bdfs(change.to_vm) == ["0000:60:00.0"] and change.to_container == ()
    back = moves(split(EIGHT, "index.6_7"), split(EIGHT, "index.0_7"))
    assert back.describe() == "to VMs: 0000:10:00.0; to containers: 0000:70:00.0"
    assert moves(split(EIGHT, "2"), split(EIGHT, "index.6-7")).describe() == "nothing moves"


# --- the split per node pool (the config's splits) ---------------------------------------

POOLS = (SplitPool({"pool": "a", "zone": "1"}, "2", "splits[0]"), SplitPool({"pool": "a"}, "all", "splits[1]"),
         SplitPool({}, "1", "splits[2]"))


@pytest.mark.parametrize(("labels", "want"), [
    ({"pool": "a", "zone": "1"}, ("2", "node pool splits[0] (matchLabels pool=a,zone=1)")),
    ({"pool": "a"}, ("all", "node pool splits[1] (matchLabels pool=a)")),  # the first that matches
    ({"pool": "b"}, ("1", "node pool splits[2] (matchLabels none: every node)")),
    ({"pool": "a", SPLIT_LABEL: "index.0"}, ("index.0", None)),  # the label wins
], ids=["all-labels", "first-match", "empty-selector", "label-wins"])
def test_the_label_wins_else_the_first_pool_whose_labels_the_node_has(labels, want):
    assert split_value(labels, POOLS) == want


def test_no_label_and_no_pool_is_no_split():
    assert split_value({"pool": "b"}, POOLS[:2]) == (None, None)
    assert split_value({}, ()) == (None, None)


def test_a_pool_value_is_split_by_the_same_rule_and_named_by_its_pool():
    gpus = [gpu(0x10 + i, 20 + i) for i in range(4)]
    share = split(gpus, "2", origin="node pool splits[0] (matchLabels pool=a)")
    assert bdfs(share.container) == bdfs(split(gpus, "2").container)
    assert share.describe().endswith(": node pool splits[0] (matchLabels pool=a): vmGpus 2")
    with pytest.raises(ConfigError, match=r"^node pool splits\[0\] \(matchLabels pool=a\): vmGpus '5' asks for 5"):
        split(gpus, "5", origin="node pool splits[0] (matchLabels pool=a)")


@pytest.mark.parametrize("value", ["2", "all", "ALL", "index.6_7", "index.4-7", "pci.c1-00.0_0000-c2-00.0",
                                   "model.2330", "model.NVIDIA-H100-80GB-HBM3"])
def test_every_form_the_label_takes_passes_the_config_check(value):
    check_value(value)


@pytest.mark.parametrize(("value", "said"), [
    ("2:3", "is not a Kubernetes label value"), ("index.4_x", "has the item 'x'"),
    ("pci.c1:00.0", "is not a Kubernetes label value"), ("pci.zz-00.0", "'zz-00.0', which is not a PCI address"),
    ("gpus.2", "is neither a count nor a selector"),
])
def test_a_bad_form_is_named_with_the_forms_it_may_take(value, said):
    with pytest.raises(ValueError, match="give a count or a selector") as err:
        check_value(value)
    assert said in str(err.value)
