"""The split label applied to a node: its GPUs scanned, split (``gpunode.policy.split``), and the
naming whose selection keeps the container share off vfio-pci. The agent, ``katamgr plan`` and the
passthrough plugin all ask here, so they agree on which GPUs are the VM share."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

from gpunode.host.files import read_json, remove_file, write_json
from gpunode.host.root import HostRoot
from gpunode.policy.gpulabels import gpu_facts
from gpunode.policy.inventory import discover
from gpunode.policy.naming import Naming
from gpunode.policy.split import SPLIT_LABEL, Split, selection_for, split


def node_split(host: HostRoot, naming: Naming, value: str | None, origin: str | None = None) -> Split:
    """The node's selected GPUs split by ``value`` (the label's, or the node pool ``origin``'s;
    None: no split). ``naming``'s selection is the one before the split (the operator's include
    and exclude rules)."""
    inv = discover(host, naming.selection, naming.nvswitch_rule)
    gpus = inv.gpus
    products = {}
    if value and value.lower().startswith("model."):
        products = {d.bdf: facts.product for d in gpus
                    if (facts := gpu_facts(d, naming.pci_ids)).product is not None}
    return split(gpus, value, nvswitches=inv.nvswitches, products=products, origin=origin)


def split_naming(host: HostRoot, naming: Naming, value: str | None,
                 origin: str | None = None) -> tuple[Naming, Split]:
    """``naming`` with its selection narrowed to the VM share, and the split itself."""
    share = node_split(host, naming, value, origin)
    selection = selection_for(naming.selection, share)
    return dataclasses.replace(naming, selection=selection), share


# Which side each GPU is on now, as katamgr carries a split out: the plugins list from this, not
# from the label, so a GPU moving is on neither side until it has left the other
# (``katamgr.agent.splitting``). Under /run: the drivers' bindings do not outlive a reboot either.
SIDES_FILE = "/run/kata-sandbox-manager/split.json"


def write_sides(host: HostRoot, vm: Iterable[str], container: Iterable[str], source: str | None = None) -> None:
    """Publish the sides (atomically: a plugin reads one whole version or the one before), and
    where the split came from (``source``: a node pool; None: the split label), for status."""
    write_json(host.path(SIDES_FILE), {"vm": sorted(vm), "container": sorted(container),
                                       "from": source or f"the label {SPLIT_LABEL}"}, marked=False)


def sides_from(host: HostRoot) -> str | None:
    """Where the published split came from (``write_sides``); None: none published, or not said."""
    try:
        data = read_json(host.path(SIDES_FILE))
    except ValueError:
        return None
    return data.get("from") if isinstance(data, dict) and isinstance(data.get("from"), str) else None


def clear_sides(host: HostRoot) -> list[str]:
    """No split: every GPU is the node's workload's. The file goes, and its dir with it where
    nothing else is left in it (in a pod the dir is a hostPath mount, which only the kubelet
    removes: left empty). The paths removed, as the node names them."""
    path = host.path(SIDES_FILE)
    removed = [SIDES_FILE] if path.exists() and remove_file(path) else []
    try:
        path.parent.rmdir()
    except OSError:  # gone already, not empty, or a mount point
        pass
    else:
        removed.append(str(Path(SIDES_FILE).parent))
    return removed


def read_sides(host: HostRoot) -> tuple[frozenset[str], frozenset[str]] | None:
    """(VM side, container side) as published; None where no split is carried out."""
    try:
        data = read_json(host.path(SIDES_FILE))
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    return frozenset(data.get("vm", ())), frozenset(data.get("container", ()))
