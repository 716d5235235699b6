"""What both plugin commands share (``sandbox-device-plugin`` and ``sandbox-dra-driver``):
their usage error, how they reach the cluster, the node's Kata release, and the mode the host
alone suggests."""

from __future__ import annotations

import dataclasses

from gpunode.errors import ConfigError
from gpunode.host.root import HostRoot
from gpunode.policy import inventory, katadetect
from gpunode.policy import selection as device_selection
from gpunode.policy.naming import Naming
from gpunode.services.simulator import REAL_NODE, NodeExtras
from sandbox_plugin.manager import Mode


class UsageError(ConfigError):
    """Bad command-line input; exit code 2."""


def cluster_client(extras: NodeExtras = REAL_NODE):
    """The cluster as both programs find it (``gpunode.services.apiclient``, with the node's
    kubeconfig rule, ``extras``); NoCluster without one."""
    from gpunode.services.apiclient import required

    return required(home_kubeconfig=extras.home_kubeconfig)


def read_labels(node_name: str, extras: NodeExtras = REAL_NODE) -> dict[str, str]:
    """The node's labels through the Kubernetes API, read as katamgr reads them
    (``gpunode.services.kube``). Raises NoCluster without credentials and GpuNodeError
    when the API does not answer (unreachable, 403, no such node)."""
    from gpunode.services.kube import read_node_labels

    return read_node_labels(cluster_client(extras), node_name)


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


def fabric_settings(args, extras: NodeExtras = REAL_NODE):
    """The NVLink fabric flags (``options.fabric_from``; ValueError naming a bad one);
    where the node brings its own Fabric Manager (``extras``, a simulated node's), FM and its
    library unless told, as ``katamgr plan`` finds them (``katamgr.commands.setup``)."""
    import dataclasses as dc

    from gpunode.services import nvlinkfabric as nf
    from gpunode.services import options

    settings = options.fabric_from(args)
    brought = extras.fabric_manager() if extras.fabric_manager is not None else None
    default = nf.FabricSettings()
    if brought is not None and (settings.address, settings.library) == (default.address, default.library):
        library, socket, modules = brought
        settings = dc.replace(settings, address=socket, library=library,
                              gpu_module_ids=settings.gpu_module_ids or modules)
    return settings
