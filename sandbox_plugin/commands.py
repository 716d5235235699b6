"""What both plugin commands share (``sandbox-device-plugin`` and ``sandbox-dra-driver``):
their usage error, how they reach the cluster, the node's Kata release, and the mode the host
alone suggests."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from katamgr.errors import ConfigError
from katamgr.host import inventory, katadetect
from katamgr.host import selection as device_selection
from katamgr.host.naming import Naming
from katamgr.host.root import HostRoot
from nodesim.node import open_node
from sandbox_plugin.manager import Mode


class UsageError(ConfigError):
    """Bad command-line input; exit code 2."""


def cluster_client(host_root: str | Path = "/"):
    """The cluster as both programs find it (``katamgr.node.apiclient``; on a simulated node
    only one named by KUBECONFIG or a service account); NoCluster without one."""
    from katamgr.node.apiclient import required

    return required(home_kubeconfig=open_node(host_root) is None)


def read_labels(node_name: str, host_root: str | Path = "/") -> dict[str, str]:
    """The node's labels through the Kubernetes API, read as katamgr reads them
    (``katamgr.node.kube``). Raises NoCluster without credentials and KatamgrError
    when the API does not answer (unreachable, 403, no such node)."""
    from katamgr.node.kube import read_node_labels

    return read_node_labels(cluster_client(host_root), node_name)


def with_node_kata(naming: Naming, host: HostRoot, containerd_config: str) -> Naming:
    """``naming`` deciding by the Kata release found on the node, as katamgr decides
    (``katadetect.node_selection``: the release of its Kata GPU runtimes, where --kata-version
    gives none; a typed one stays the override)."""
    return dataclasses.replace(naming, selection=katadetect.node_selection(naming.selection, host,
                                                                           containerd_config))


def mode_from_host(
    host: HostRoot, selection: device_selection.Selection = device_selection.DEFAULT_SELECTION,
) -> tuple[Mode, str]:
    inv = inventory.discover(host, selection)
    on_vfio = [d.bdf for d in inv.passthrough if d.on_vfio]
    if on_vfio:
        return Mode.VM_PASSTHROUGH, f"passthrough device(s) {', '.join(on_vfio)} are bound to vfio-pci"
    if selection.is_default:
        return Mode.CONTAINER, "no NVIDIA GPU is bound to vfio-pci"
    return Mode.CONTAINER, "no passthrough device (as --include-device/--exclude-device select) is bound to vfio-pci"


def fabric_settings(args, host: HostRoot):
    """The NVLink fabric flags (``options.fabric_from``; ValueError naming a bad one);
    on a simulated node whose Fabric Manager runs, where FM and its library are unless told,
    as ``katamgr plan`` finds them (``katamgr.cli.fabric_settings``)."""
    import dataclasses as dc

    from katamgr.node import nvlinkfabric as nf
    from katamgr.node import options
    from nodesim.node import open_node

    settings = options.fabric_from(args)
    node = open_node(host.root)
    simulated = node.fabric_manager() if node is not None else None
    default = nf.FabricSettings()
    if simulated is not None and (settings.address, settings.library) == (default.address, default.library):
        library, socket, modules = simulated
        settings = dc.replace(settings, address=socket, library=library,
                              gpu_module_ids=settings.gpu_module_ids or modules)
    return settings
