"""The simulated node as the programs find it: the object behind the entry point ``node``
of the group ``kata_sandbox_manager.simulator`` (pyproject.toml; ``KATAMGR_SIMULATOR=
nodesim.launch:SIMULATOR`` where that is not registered), implementing
``gpunode.services.simulator.Simulator``.

It builds what a simulated node brings (its root with the emulated kernel, its NVML, its
Fabric Manager, its kubelet and Kata shim stand-ins) and hands them to the programs as
explicit settings; they never import this package. Loading it imports nothing else: the
profiles, the emulated kernel and the stand-ins (grpcio) load when a command asks for them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from gpunode.host.root import HostRoot
from gpunode.services.simulator import NodeExtras, ProfileInfo


class NodeSimulator:
    """``gpunode.services.simulator.Simulator`` over this package."""

    @property
    def cold_plug_error(self) -> type[Exception]:
        from nodesim.kata_shim import ColdPlugError

        return ColdPlugError

    def profile_names(self) -> list[str]:
        from nodesim.profiles import shipped_names

        return shipped_names()

    def profile(self, name_or_path: str) -> ProfileInfo:
        from nodesim.profiles import find_profile

        profile = find_profile(name_or_path)
        return ProfileInfo(profile.name, profile.description, len(profile.devices))

    def materialise(self, name_or_path: str, into: Path, *, real_device_nodes: bool = False) -> HostRoot:
        from nodesim.materialise import materialise
        from nodesim.profiles import find_profile

        return materialise(find_profile(name_or_path), into, real_device_nodes=real_device_nodes)

    def open_root(self, root: Path, runtime_root: str = "/") -> tuple[HostRoot, NodeExtras] | None:
        from nodesim.node import open_node

        node = open_node(root, runtime_root)
        if node is None:
            return None
        # A simulated node uses a cluster only when one is named (KUBECONFIG or the pod's
        # service account, as the chart's DaemonSets on a simulated node have), and brings
        # its own NVML (answering from its sysfs) and Fabric Manager.
        return node.host, NodeExtras(home_kubeconfig=False, nvml=node.nvml,
                                     fabric_manager=node.fabric_manager)

    def kubelet(self, host: HostRoot) -> AbstractContextManager[Any]:
        from nodesim.kubelet import KubeletSimulator

        return KubeletSimulator(host)

    def cold_plug(self, host: HostRoot, pod_resources_socket: Path, namespace: str, name: str) -> Any:
        from nodesim import kata_shim

        return kata_shim.cold_plug(host, pod_resources_socket, kata_shim.sandbox_annotations(namespace, name))


SIMULATOR = NodeSimulator()
