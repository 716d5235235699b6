"""A simulated node's power cycle (``nodesim.reboot``), which ``hack/local-cluster reboot``
runs on the local node's host: what Linux keeps across a boot and what it does not."""

from __future__ import annotations

import subprocess
import sys

from support.nodekit import nvidia_drivers
from support.paths import REPO

from nodesim import kernel
from nodesim.materialise import materialise
from nodesim.profiles import find_profile
from nodesim.reboot import main


def test_a_boot_puts_every_device_on_its_boot_driver_and_empties_tmpfs(tmp_path):
    """Run as hack/localcluster.py runs it: ``python -m nodesim.reboot ROOT``."""
    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    booted = nvidia_drivers(host.root)
    gpu = next(bdf for bdf, driver in booted.items() if driver == "nvidia")
    # What katamgr's bind does: vfio-pci loaded, driver_override, unbind, drivers_probe.
    kernel.EMULATED.modprobe(host, "vfio-pci")
    kernel.handle_change(host, f"/sys/bus/pci/devices/{gpu}/driver_override", "vfio-pci")
    kernel.handle_change(host, "/sys/bus/pci/drivers/nvidia/unbind", gpu)
    kernel.handle_change(host, "/sys/bus/pci/drivers_probe", gpu)
    group = host.path(f"/sys/bus/pci/devices/{gpu}/iommu_group").resolve().name
    assert nvidia_drivers(host.root)[gpu] == "vfio-pci" and host.path(f"/dev/vfio/{group}").exists()
    cdi = host.path("/var/run/cdi")
    cdi.mkdir(parents=True, exist_ok=True)
    (cdi / "nvidia.com-pgpu.yaml").write_text("kind: nvidia.com/pgpu\n")
    kept = host.path("/etc/containerd/config.toml")
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text("version = 3\n")

    def boot() -> str:
        result = subprocess.run([sys.executable, "-m", "nodesim.reboot", str(host.root)], capture_output=True,
                                text=True, cwd=REPO, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout

    said = boot()
    assert nvidia_drivers(host.root) == booted
    assert host.path(f"/sys/bus/pci/devices/{gpu}/driver_override").read_text() == "(null)\n"
    assert not host.path(f"/dev/vfio/{group}").exists() and not host.path("/dev/vfio/vfio").exists()
    assert not host.path("/sys/bus/pci/drivers/vfio-pci").exists()  # loaded again by katamgr's bind
    assert list(cdi.iterdir()) == [] and kept.read_text() == "version = 3\n"
    assert said.splitlines() == ["vfio-pci not loaded", f"{gpu}: vfio-pci -> nvidia",
                                 "/var/run/cdi/nvidia.com-pgpu.yaml gone (tmpfs)"], said
    assert boot() == ""  # a second boot finds nothing to change


def test_the_command_refuses_a_root_that_is_not_simulated(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "not a simulated node's root" in capsys.readouterr().err
    assert main([]) == 2
