"""Where the programs meet the simulated node without importing it.

The simulated node (``nodesim``) is a development package: the product never imports it.
It is found, when installed, through the Python entry point ``node`` of the group
``kata_sandbox_manager.simulator`` (declared in pyproject.toml), or through the
``KATAMGR_SIMULATOR`` environment variable naming the same object as ``module:attribute``
(an editable install made before the entry point existed, the tests). What it gives is the
``Simulator`` protocol below: host profiles made into roots, a root of its own opened with
its emulated kernel, and the stand-ins the demo talks to.

A simulator marks every root it makes with the file ``MARKER``, and ``open_host`` offers it
only such a root: on a real node a program start costs one stat, not the entry point scan
(``importlib.metadata``, about 15 ms and 1.4 MiB of the device plugin's start) nor the
simulator's import. The programs' entry points open a host root with ``open_host`` and hand
what it found down as explicit settings (``NodeExtras``: the kubeconfig rule, the NVML for the container
plugin, where Fabric Manager runs); nothing below an entry point asks whether its root is
simulated.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pkgutil
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gpunode.errors import ConfigError
from gpunode.host.root import KUBELET_DIR, HostRoot

GROUP = "kata_sandbox_manager.simulator"
NAME = "node"
ENV = "KATAMGR_SIMULATOR"
# In /sys: the one host dir every container of the chart mounts (so a simulated node is one
# inside the pods too), and one where a real node can hold no such file.
MARKER = "sys/katamgr-simulated-host"


@dataclass(frozen=True)
class NodeExtras:
    """What a node brings beside its files, handed to the code that needs it.

    ``home_kubeconfig``: whether ``~/.kube/config`` may name the cluster (a simulated node
    uses one only when KUBECONFIG or a service account names it); ``nvml``: a factory of the
    node's NVML for the container plugin (None: NVIDIA's ``pynvml``); ``fabric_manager``: where
    the node's Fabric Manager runs unless told, as (SDK library path, socket as a host path,
    GPU module IDs), or None."""

    home_kubeconfig: bool = True
    nvml: Callable[[], object] | None = None
    fabric_manager: Callable[[], tuple[str, str, str] | None] | None = None


REAL_NODE = NodeExtras()  # a node that brings nothing beyond its files


@dataclass(frozen=True)
class ProfileInfo:
    """A host profile as the commands describe it."""

    name: str
    description: str
    devices: int


class Simulator(Protocol):
    """What the simulated node offers the programs (``nodesim.launch`` implements it)."""

    cold_plug_error: type[Exception]

    def profile_names(self) -> list[str]: ...

    def profile(self, name_or_path: str) -> ProfileInfo: ...

    def materialise(self, name_or_path: str, into: Path, *, real_device_nodes: bool = False) -> HostRoot: ...

    def open_root(self, root: Path, runtime_root: str = "/") -> tuple[HostRoot, NodeExtras] | None: ...

    def kubelet(self, host: HostRoot) -> AbstractContextManager[Any]: ...

    def cold_plug(self, host: HostRoot, pod_resources_socket: Path, namespace: str, name: str) -> Any: ...


@functools.cache
def installed() -> Simulator | None:
    """The installed simulated node, or None (a production install has none)."""
    spec = os.environ.get(ENV)
    if not spec:
        from importlib.metadata import entry_points

        found = next(iter(entry_points(group=GROUP, name=NAME)), None)
        if found is None:
            return None
        spec = found.value
    try:
        return pkgutil.resolve_name(spec)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"the simulated node {spec!r} cannot be loaded ({exc}); "
                          f"fix or unset {ENV}") from None


def required(what: str) -> Simulator:
    """The simulated node, or a ConfigError saying ``what`` needs it installed."""
    sim = installed()
    if sim is None:
        raise ConfigError(f"{what} needs the simulated node (nodesim), which is not installed here: "
                          f"install kata-sandbox-manager from its source tree, or set "
                          f"{ENV}=nodesim.launch:SIMULATOR")
    return sim


def open_host(root: str | Path, runtime_root: str = "/",
              kubelet_dir: str = KUBELET_DIR) -> tuple[HostRoot, NodeExtras]:
    """The host root at ``root`` and what its node brings: an installed simulator's own root
    (``katamgr simulate`` made it) with its emulated kernel, else the real kernel's."""
    if not (Path(root) / MARKER).is_file():
        return HostRoot.at(root, runtime_root=runtime_root, kubelet_dir=kubelet_dir), REAL_NODE
    sim = installed()
    opened = sim.open_root(Path(root), runtime_root) if sim is not None else None
    if opened is not None:
        return dataclasses.replace(opened[0], kubelet_dir=kubelet_dir), opened[1]
    return HostRoot.at(root, runtime_root=runtime_root, kubelet_dir=kubelet_dir), REAL_NODE


def node_extras(root: str | Path, runtime_root: str = "/") -> NodeExtras:
    """What the node at ``root`` brings (``open_host``), for a program that opens the root itself."""
    return open_host(root, runtime_root)[1]
