"""NVIDIA's gpu-admin-tools, run for real against a simulated Hopper node.

The tool finds GPUs by scanning ``/sys/bus/pci/devices``, reads each one's ``config`` and
``resource`` and maps BAR0 from ``resource0`` (``pci/device.py``, ``PciDevice``); its
``--query-cc-mode`` then reads the GPU's boot and CC status registers. The simulator writes
those files (``nodesim.pcifiles``, ``gpuregs``), so here the tool's own command
runs unchanged with the simulated node's ``sys`` bind-mounted over ``/sys`` in a private mount
namespace (``unshare -m``, as root), and katamgr's in-process calls of the tool
(``gpunode.host.gpuadmin``) read the same files below the host root. Staging a mode goes
through the GPU's FSP mailbox, which no file can answer: that half is the simulator's
(``nodesim.gpu``) and is checked on a real GPU only (docs/testing.md).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from support.paths import REPO, REQUIRE_INTEGRATION

from gpunode.host.cc import CcMode, Reading
from gpunode.host.gpuadmin import NVIDIA_GPU_TOOLS
from nodesim.gpu import EMULATED_GPU_ADMIN
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

GPUS = ["0000:03:00.0", "0000:04:00.0", "0000:13:00.0", "0000:14:00.0",
        "0000:83:00.0", "0000:84:00.0", "0000:93:00.0", "0000:94:00.0"]


def switch_emulated(host, bdfs, mode):
    """Stage and reset as katamgr's switch does (the devices unbound first)."""
    for bdf in bdfs:
        host.kernel.write(host, "/sys/bus/pci/drivers/nvidia/unbind", bdf)
        EMULATED_GPU_ADMIN.stage(host, bdf, mode)
    EMULATED_GPU_ADMIN.reset(host, bdfs)


def test_katamgr_reads_the_simulated_gpus_through_nvidias_tool(tmp_path):
    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    switch_emulated(host, GPUS[:3], CcMode.ON)
    switch_emulated(host, GPUS[3:4], CcMode.DEVTOOLS)
    for bdf in GPUS:
        # The tool's reading of the registers agrees with the emulated kernel's modes.
        assert NVIDIA_GPU_TOOLS.query(host, bdf) == EMULATED_GPU_ADMIN.query(host, bdf)
    assert NVIDIA_GPU_TOOLS.query(host, GPUS[0]) == Reading("on", "off")
    assert NVIDIA_GPU_TOOLS.query(host, GPUS[3]) == Reading("devtools", "off")
    assert NVIDIA_GPU_TOOLS.query(host, GPUS[5]) == Reading("off", "off")


def _can_unshare() -> str | None:
    if os.geteuid() != 0:
        return "a private mount namespace over /sys needs root"
    if shutil.which("unshare") is None:
        return "util-linux's unshare is missing"
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True, check=False)
    return None if probe.returncode == 0 else f"unshare -m refused: {probe.stderr.strip()}"


def test_the_tools_own_query_reads_a_simulated_gh100_at_sys(tmp_path):
    why = _can_unshare()
    if why:
        if REQUIRE_INTEGRATION:
            pytest.fail(why)
        pytest.skip(why)
    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    switch_emulated(host, GPUS[:2], CcMode.ON)
    switch_emulated(host, GPUS[2:3], CcMode.DEVTOOLS)
    script = (f"mount --bind {host.path('/sys')} /sys && cd / && "
              f"{sys.executable} -m nvidia_gpu_tools --devices gpus --query-cc-mode")
    result = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True,
                            timeout=120, check=False, cwd=REPO)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    modes = dict(re.findall(r"GPU (\S+) H100 0x2330 .* CC mode is (\S+)", out))
    assert modes == {GPUS[0]: "on", GPUS[1]: "on", GPUS[2]: "devtools",
                     **{bdf: "off" for bdf in GPUS[3:]}}, out


def test_the_tool_cannot_open_a_device_that_is_not_there(tmp_path):
    from gpunode.host.errors import HostError

    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    with pytest.raises(HostError, match="0000:77:00.0"):
        NVIDIA_GPU_TOOLS.query(host, "0000:77:00.0")
