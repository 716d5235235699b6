"""Fixtures for the runtime tests (containerd config, Kata config, reloads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpunode.host.root import HostRoot


@pytest.fixture
def host(tmp_path: Path) -> HostRoot:
    """An empty host root (the node's ``/``) in the test's temp dir."""
    return HostRoot.at(tmp_path / "host")
