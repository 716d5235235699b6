"""An NVSwitch node's Fabric Manager: the stand-in SDK library (``nodesim.fabricmanager``,
compiled by the machine's gcc) and its state, under a temporary root."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from nodesim import fabricmanager as fmsim

# dgx-h100's GPUs in bus order, given module IDs 1-8 (on a real board the wiring fixes them;
# nvidia-smi -q shows them as "Module ID").
H100_GPUS = ("0000:03:00.0", "0000:04:00.0", "0000:13:00.0", "0000:14:00.0",
             "0000:83:00.0", "0000:84:00.0", "0000:93:00.0", "0000:94:00.0")
H100_MODULES = {i + 1: bdf for i, bdf in enumerate(H100_GPUS)}


class FmNode:
    def __init__(self, root, spec: fmsim.FabricManagerSpec) -> None:
        self.root = root
        self.spec = spec
        self.library = str(fmsim.start(root, spec))
        self.socket = str(root / spec.socket.lstrip("/"))

    def active(self) -> list[int]:
        return fmsim.active(self.root)

    def stop(self) -> None:
        fmsim.stop(self.root)

    def restart(self) -> None:
        fmsim.restart(self.root)

    def delay(self, ms: int) -> None:
        fmsim.set_delay(self.root, ms)


@pytest.fixture
def h100_fm(tmp_path) -> FmNode:
    return FmNode(tmp_path, fmsim.FabricManagerSpec("hgx-h100", "shared", H100_MODULES))


@pytest.fixture
def a100_fm(tmp_path) -> FmNode:
    return FmNode(tmp_path, fmsim.FabricManagerSpec("hgx-a100", "shared", H100_MODULES))


@pytest.fixture
def short_fm():
    """FM under a short root: a unix socket's path holds 107 bytes, pytest's tmp_path is long."""
    root = Path(tempfile.mkdtemp(prefix="fm-", dir="/tmp"))
    try:
        yield FmNode(root, fmsim.FabricManagerSpec("hgx-h100", "shared", H100_MODULES))
    finally:
        shutil.rmtree(root, ignore_errors=True)
