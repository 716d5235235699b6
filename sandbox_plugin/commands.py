"""What both plugin commands share (``sandbox-device-plugin`` and ``sandbox-dra-driver``):
their usage error, how they reach the cluster, the node's context, and the mode the host
alone suggests."""

from __future__ import annotations

from gpunode.errors import ConfigError
from gpunode.host.root import HostRoot
from gpunode.policy import inventory
from gpunode.policy import selection as device_selection
from gpunode.services import nodecontext
from gpunode.services.nodecontext import NodeContext
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


def node_context(args) -> NodeContext:
    """The node's context (``gpunode.services.nodecontext``) as both programs build it: their
    fabric step asks Fabric Manager as their gate does (``fabricgate.ask_guarded``)."""
    from sandbox_plugin.fabricgate import ask_guarded

    return nodecontext.build(args, ask=ask_guarded)


def mode_from_host(
    host: HostRoot, selection: device_selection.Selection = device_selection.DEFAULT_SELECTION,
    nvswitch_rule: device_selection.NvswitchRule = device_selection.DEFAULT_NVSWITCH_RULE,
) -> tuple[Mode, str]:
    inv = inventory.discover(host, selection, nvswitch_rule)
    on_vfio = [d.bdf for d in inv.passthrough if d.on_vfio]
    if on_vfio:
        return Mode.VM_PASSTHROUGH, f"passthrough device(s) {', '.join(on_vfio)} are bound to vfio-pci"
    if selection.is_default:
        return Mode.CONTAINER, "no NVIDIA GPU is bound to vfio-pci"
    return Mode.CONTAINER, "no passthrough device (as --include-device/--exclude-device select) is bound to vfio-pci"
