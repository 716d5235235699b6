"""Fixtures for the device plugin tests, around the kubelet simulator
(nodesim.kubelet): ``short_root``, ``kubelet`` and ``sim_host``.

Host roots are short temp dirs: a unix socket path must fit in 107 bytes, and
pytest's own tmp_path names are long.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from katamgr.host.root import HostRoot
from nodesim.kubelet import KubeletSimulator


@pytest.fixture
def short_root() -> Iterator[HostRoot]:
    directory = tempfile.mkdtemp(prefix="kp-")
    try:
        yield HostRoot.at(Path(directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def kubelet(short_root: HostRoot) -> Iterator[KubeletSimulator]:
    sim = KubeletSimulator(short_root)
    sim.start()
    try:
        yield sim
    finally:
        sim.stop()


@pytest.fixture
def sim_host() -> Iterator:
    """Factory: ``sim_host(profile)`` materialises a host profile (a name, a path
    or a parsed HostProfile) into a new short temp root and starts a kubelet
    simulator there; returns ``(HostRoot, KubeletSimulator)``. Cleaned up after
    the test."""
    from nodesim.materialise import materialise
    from nodesim.profile import HostProfile
    from nodesim.profiles import find_profile

    started: list[tuple[str, KubeletSimulator]] = []

    def make(profile) -> tuple[HostRoot, KubeletSimulator]:
        if not isinstance(profile, HostProfile):
            profile = find_profile(str(profile))
        directory = tempfile.mkdtemp(prefix="kp-")
        host = materialise(profile, directory)
        sim = KubeletSimulator(host)
        sim.start()
        started.append((directory, sim))
        return host, sim

    yield make
    for directory, sim in started:
        sim.stop()
        shutil.rmtree(directory, ignore_errors=True)
