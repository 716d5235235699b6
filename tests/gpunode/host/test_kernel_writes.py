"""Writes to the real kernel that it may hold: bounded, reported, never a hang.

Fact (Linux 6.1 drivers/vfio/vfio_main.c, vfio_unregister_group_dev, and seen on
Debian's 6.1 kernel under QEMU by tests/kernel): writing ``unbind`` for a device
whose VFIO group a process holds blocks the writer until the holder exits, and
after a signal that wait is uninterruptible. A FIFO with no reader is a real
file whose ``open(O_WRONLY)`` blocks the same way, so it stands in for the
held ``unbind`` file here, with the real ``LinuxKernel``. (The FIFO holds the
writer in ``open()``, the kernel in ``write()``; to the caller both are a child
that does not return. tests/kernel shows the kernel's own.)
"""

from __future__ import annotations

import os
import time

import pytest

from gpunode.host import kernel
from gpunode.host.errors import HostError
from gpunode.host.kernel import BlockedWrite, LinuxKernel
from gpunode.host.root import HostRoot


def _root(tmp_path, kern: LinuxKernel) -> HostRoot:
    (tmp_path / "sys/bus/pci/drivers/vfio-pci").mkdir(parents=True)
    return HostRoot.at(tmp_path, kernel=kern)


def test_a_write_the_kernel_holds_returns_within_the_bound_and_completes_later(tmp_path):
    host = _root(tmp_path, LinuxKernel(write_timeout=0.5))
    unbind = host.path("/sys/bus/pci/drivers/vfio-pci/unbind")
    os.mkfifo(unbind)
    started = time.monotonic()
    with pytest.raises(BlockedWrite) as caught:
        host.kernel.write(host, "/sys/bus/pci/drivers/vfio-pci/unbind", "0000:01:00.0")
    assert time.monotonic() - started < 5
    message = str(caught.value)
    assert "/sys/bus/pci/drivers/vfio-pci/unbind" in message and "'0000:01:00.0'" in message
    assert f"process {caught.value.pid}" in message
    assert caught.value.pid in kernel.pending_writes()
    # A second write to the same file would only queue behind the first, one more
    # process stuck: refused at once, naming the first.
    started = time.monotonic()
    with pytest.raises(BlockedWrite, match="an earlier write to /sys/bus/pci/drivers/vfio-pci/unbind is still pending") as again:
        host.kernel.write(host, "/sys/bus/pci/drivers/vfio-pci/unbind", "0000:02:00.0")
    assert time.monotonic() - started < 0.5 and again.value.pid == caught.value.pid
    # The holder lets go: the write the kernel held goes through, and the
    # writer is reaped.
    fd = os.open(unbind, os.O_RDONLY)
    try:
        deadline = time.monotonic() + 10
        data = b""
        while not data.endswith(b"0000:01:00.0") and time.monotonic() < deadline:
            data += os.read(fd, 64)
    finally:
        os.close(fd)
    assert data == b"0000:01:00.0"
    deadline = time.monotonic() + 10
    while caught.value.pid in kernel.pending_writes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert caught.value.pid not in kernel.pending_writes()


def test_bounded_write_lands_and_a_refusal_names_the_file(tmp_path):
    host = _root(tmp_path, LinuxKernel())
    probe = host.path("/sys/bus/pci/drivers_probe")
    probe.write_text("")
    host.kernel.write(host, "/sys/bus/pci/drivers_probe", "0000:01:00.0")
    assert probe.read_text() == "0000:01:00.0"
    with pytest.raises(HostError, match="cannot open /sys/bus/pci/drivers/nvidia/unbind for writing"):
        host.kernel.write(host, "/sys/bus/pci/drivers/nvidia/unbind", "0000:01:00.0")


def test_driver_override_is_written_directly(tmp_path):
    host = _root(tmp_path, LinuxKernel(write_timeout=10.0))
    override = host.path("/sys/bus/pci/devices/0000:01:00.0/driver_override")
    override.parent.mkdir(parents=True)
    override.write_text("")
    host.kernel.write(host, "/sys/bus/pci/devices/0000:01:00.0/driver_override", "vfio-pci\n")
    assert override.read_text() == "vfio-pci\n"


def test_a_missing_control_file_is_never_created(tmp_path):
    host = _root(tmp_path, LinuxKernel())
    with pytest.raises(HostError, match="cannot open /sys/bus/pci/drivers/vfio-pci/unbind for writing"):
        host.kernel.write(host, "/sys/bus/pci/drivers/vfio-pci/unbind", "0000:01:00.0")
    assert not host.path("/sys/bus/pci/drivers/vfio-pci/unbind").exists()


def test_a_bind_the_kernel_holds_keeps_the_device_recorded_for_revert(tmp_path):
    """The unbind from the GPU's driver is held (a FIFO stands in for it, as above): the
    move finishes by itself when the device is released, leaving it driverless, so its
    record of the original driver must stay for katamgr revert."""
    from support.hostkit import GPU_A10, dev, make_host

    from gpunode.host import vfio
    from gpunode.host.pciids import PciIds
    from gpunode.policy.naming import Naming
    from katamgr.pipeline.devices import apply_host
    from katamgr.pipeline.plan import build_plan

    simulated = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4)])
    host = HostRoot.at(simulated.root, kernel=LinuxKernel(write_timeout=0.3))
    unbind = host.path("/sys/bus/pci/drivers/nvidia/unbind")
    unbind.unlink(missing_ok=True)
    os.mkfifo(unbind)
    report = apply_host(host, build_plan(host, Naming(PciIds.find())))
    assert not report.ok
    [failure] = report.failures
    assert "binding IOMMU group 4 stopped" in failure and "did not finish '0000:01:00.0'" in failure
    assert "0000:01:00.0 stays recorded" in failure and "returns it to nvidia" in failure
    assert vfio.bound_by_us(host)["0000:01:00.0"]["driver"] == "nvidia"
    fd = os.open(unbind, os.O_RDONLY | os.O_NONBLOCK)  # let the pending writer finish
    try:
        deadline = time.monotonic() + 10
        while kernel.pending_writes() and time.monotonic() < deadline:
            try:
                os.read(fd, 64)
            except BlockingIOError:
                pass
            time.sleep(0.05)
    finally:
        os.close(fd)
    assert kernel.pending_writes() == []
