"""The kernel a host root carries: real by default, emulated on simulated roots."""

from __future__ import annotations

import pytest
from support.hostkit import GPU_A10, dev, make_host

from gpunode.host import vfiogroups
from gpunode.host.errors import HostError
from gpunode.host.kernel import LINUX
from gpunode.host.root import HostRoot
from nodesim.kernel import EMULATED
from nodesim.marker import MARKER
from nodesim.node import open_node, open_root


def test_a_root_opened_by_path_has_the_real_kernel(tmp_path):
    assert HostRoot.at(tmp_path).kernel is LINUX
    assert HostRoot().kernel is LINUX
    assert open_root(tmp_path).kernel is LINUX
    assert open_node(tmp_path) is None
    assert open_node("/") is None


def test_a_simulated_root_keeps_its_emulated_kernel_when_opened_again(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4)])
    assert host.kernel == EMULATED
    again = open_root(host.root)
    assert again == host and open_node(host.root).host == host


def test_the_real_kernel_ignores_the_simulator_marker(tmp_path):
    # Only the simulator reads its marker: a root opened as a real one writes files.
    (tmp_path / MARKER).parent.mkdir(parents=True)
    (tmp_path / MARKER).write_text("{}")
    control = tmp_path / "sys/bus/pci/drivers_probe"
    control.parent.mkdir(parents=True, exist_ok=True)
    control.write_text("")
    host = HostRoot.at(tmp_path)
    host.kernel.write(host, "/sys/bus/pci/drivers_probe", "0000:01:00.0")
    assert control.read_text() == "0000:01:00.0"
    with pytest.raises(HostError, match="cannot open /sys/bus/pci/nothing for writing"):
        host.kernel.write(host, "/sys/bus/pci/nothing", "1")


@pytest.mark.parametrize(("index", "expected"), [
    ("kernel/drivers/vfio/pci/vfio-pci.ko.zst: kernel/drivers/vfio/vfio.ko.zst\n", vfiogroups.VfioModule.LOADABLE),
    ("kernel/drivers/net/e1000e/e1000e.ko:\n", vfiogroups.VfioModule.MISSING),
])
def test_the_real_kernel_finds_vfio_pci_in_the_roots_modules(tmp_path, index, expected):
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/osrelease").write_text("6.1.0-test\n")
    (tmp_path / "lib/modules/6.1.0-test").mkdir(parents=True)
    (tmp_path / "lib/modules/6.1.0-test/modules.dep").write_text(index)
    assert vfiogroups.vfio_module(HostRoot.at(tmp_path)) is expected
