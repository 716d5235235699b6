"""The split of a node's GPUs between Kata VMs and containers (gpunode.policy.split): the label's
grammar, whole IOMMU groups, NVSwitches kept with the container share, and the selection the
agent and the passthrough plugin follow."""

from __future__ import annotations

import pytest

from gpunode.errors import ConfigError
from gpunode.host.pci import Device
from gpunode.policy.selection import DEFAULT_SELECTION, select
from gpunode.policy.split import SPLIT_LABEL, moves, selection_for, split

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
