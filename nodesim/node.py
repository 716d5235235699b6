"""A simulated node as one thing: its root, and what the node simulates for the programs.

A real node brings its kernel, its udev and NVIDIA's driver with it; a simulated one
(``katamgr simulate``) brings stand-ins for each, and this is where a program gets them.
``open_node`` is the one answer to "is this root a simulated node" (the marker the
simulator writes into it, ``nodesim.marker.MARKER``) and gives back the ``SimulatedNode``:

- ``host``: the ``HostRoot`` with the emulated kernel installed (``gpunode.host`` never asks
  which kernel it talks to);
- ``nvml()``: the NVML of the node (``nvml.FakeNvml`` following the node's sysfs), for the
  container plugin in the place of ``pynvml``;
- ``host_udev``: whether its ``/dev/vfio`` is kept by the machine's udev stand-in (``udev``)
  rather than by the emulated kernel.

The programs reach it only through ``nodesim.launch`` (the entry point they find it by,
``gpunode.services.simulator``); they never import this package, a contract in
``pyproject.toml`` says so, and a real node's root never becomes a simulated one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpunode.host.root import HostRoot
from nodesim import kernel
from nodesim.marker import MARKER


@dataclass(frozen=True)
class SimulatedNode:
    host: HostRoot

    def nvml(self) -> object:
        """A fresh NVML for this node, answering from its sysfs as the driver would."""
        from nodesim.nvml import FakeNvml

        return FakeNvml.for_simulated_host(self.host)

    def fabric_manager(self) -> tuple[str, str, str] | None:
        """The node's Fabric Manager as an operator would point katamgr at it: (the SDK
        library's path on this machine, FM's socket as a host path, the GPUs' module IDs as
        nvidia-smi shows them); None where FM does not run here."""
        from nodesim import fabricmanager

        library = self.host.path(fabricmanager.LIBRARY)
        state = fabricmanager.state_of(self.host.path(fabricmanager.SOCKET))
        if not library.is_file() or not state.is_file():
            return None
        ids = [line.split()[1:3] for line in state.read_text().splitlines() if line.startswith("gpu ")]
        modules = ",".join(f"{n}={bus.lower()[4:]}" for n, bus in ids)  # 00000000:03:00.0 -> 0000:03:00.0
        return str(library), fabricmanager.SOCKET, modules

    @property
    def host_udev(self) -> bool:
        return kernel.host_udev(self.host)


def open_node(root: str | Path, runtime_root: str = "/") -> SimulatedNode | None:
    """The simulated node at ``root``, or None when ``root`` is not one (``/`` never is)."""
    host = HostRoot.at(root, runtime_root=runtime_root)
    if host.is_real_root or not (host.root / MARKER).is_file():
        return None
    return SimulatedNode(HostRoot(host.root, kernel.EMULATED, runtime_root))


def open_root(root: str | Path, runtime_root: str = "/") -> HostRoot:
    """The host root at ``root``: a simulated node's with its emulated kernel, else the
    real kernel's."""
    node = open_node(root, runtime_root)
    return node.host if node else HostRoot.at(root, runtime_root=runtime_root)
