"""Fixtures for the device plugin tests, around the kubelet simulator
(nodesim.kubelet): ``short_root``, ``kubelet``, ``sim_host``, and ``start_plugin`` (the
plugin as its own process, pluginproc.py).

Host roots are short temp dirs: a unix socket path must fit in 107 bytes, and
pytest's own tmp_path names are long.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from pluginproc import Plugin

from gpunode.host.pciids import PciIds
from gpunode.host.root import HostRoot
from gpunode.policy.naming import Naming, resource_name
from kubeletapi.deviceplugin_paths import DEVICE_PLUGIN_DIR, socket_name_for
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


@pytest.fixture
def start_plugin(sim_host, tmp_path) -> Iterator:
    """Factory: ``start_plugin(nofile=0, idle_timeout=3.0)`` runs the plugin as its own process on a simulated
    DGX H100 bound to vfio-pci (pluginproc.Plugin), and returns it once it registered with
    the kubelet simulator, whose ListAndWatch stays open. Stopped after the test."""
    from katamgr.pipeline.devices import apply_host
    from katamgr.pipeline.plan import build_plan

    naming = Naming(PciIds.find())
    h100 = resource_name(naming.pci_ids, 0x10DE, 0x2330)
    started: list[Plugin] = []

    def start(nofile: int = 0, idle_timeout: float = 3.0) -> Plugin:
        host, kubelet = sim_host("dgx-h100")
        assert apply_host(host, build_plan(host, naming)).ok
        plugin = Plugin.launch(host.root, host.path(DEVICE_PLUGIN_DIR) / socket_name_for(h100),
                               tmp_path / f"plugin-{len(started)}.log", nofile, idle_timeout)
        started.append(plugin)
        try:
            kubelet.wait_for(lambda state: len(state.devices.get(h100, [])) == 8, timeout=30)
        except TimeoutError:
            raise AssertionError(plugin.log.read_text()) from None
        return plugin

    yield start
    for plugin in started:
        plugin.stop()
