"""The node labels the agent keeps on its Node: the GPU labels (``gpunode.policy.gpulabels``
says what they are) and the Kata release found (``katacontainers.io/kata-version``,
``gpunode.policy.katadetect``), both by the same rules and in the same record.

GFD and NFD own the GPU labels where they run: a label some other writer set is never
overwritten, even with a different value (``publish`` warns instead, and the agent records
an Event); a label the agent set and someone changed since is given up to them. Only what
the agent set is recorded, and a revert removes a recorded label only while it still holds
the value the agent set.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpunode.errors import GpuNodeError
from gpunode.host.root import HostRoot
from gpunode.policy import gpulabels
from gpunode.policy.inventory import Inventory
from gpunode.policy.kata import release_json
from gpunode.policy.naming import Naming
from katamgr.pipeline.plan import PlanSection
from katamgr.pipeline.report import Report

if TYPE_CHECKING:
    from gpunode.policy.katadetect import KataOnNode


@dataclass(frozen=True)
class NodeLabels:
    """Our Node's labels: ``read()`` them now (a watch's copy may be a moment behind),
    ``patch({key: value or None})`` (None removes); ``read_fresh()``, where given, asks the
    API server itself, and is used only when ``read()`` says there is something to do."""

    read: Callable[[], Mapping[str, str]]
    patch: Callable[[dict[str, str | None]], None]
    read_fresh: Callable[[], Mapping[str, str]] | None = None


def node_labels(api: object, node_name: str, watch=None) -> NodeLabels:
    """Our Node's labels through the API: read (from ``watch``, a ``NodeLabelWatch``, when
    there is one) and patched."""
    from gpunode.services.kube import read_node_labels
    from katamgr.cluster import set_node_labels  # the Kubernetes client: only with a cluster

    def fresh():
        return read_node_labels(api, node_name)

    return NodeLabels(watch.labels if watch is not None else fresh,
                      lambda labels: set_node_labels(api, node_name, labels),
                      fresh if watch is not None else None)


def _decide(wanted: Mapping[str, str], current: Mapping[str, str], owned: Mapping[str, str],
            keys: tuple[str, ...] = gpulabels.RECORDED_KEYS,
            ) -> tuple[dict[str, str | None], dict[str, str], list[str]]:
    """(the patch, what katamgr owns after it, warnings) for one look at the Node at ``keys``
    (what katamgr owns of the others is left as it is)."""
    patch: dict[str, str | None] = {}
    keep = dict(owned)
    warnings: list[str] = []
    for key in keys:
        want, have = wanted.get(key), current.get(key)
        if key in owned:
            if have is not None and have != owned[key]:
                # Someone else (GFD, NFD, an operator) wrote it since: theirs now.
                del keep[key]
                warnings.append(f"node label {key}={have} was changed by someone else (katamgr set "
                                f"{owned[key]}): left to them")
            elif want is None:
                patch[key] = None
                del keep[key]
            elif have != want:
                patch[key] = keep[key] = want
        elif want is not None:
            if have is None:
                patch[key] = keep[key] = want
            elif key == gpulabels.KATA_RELEASE and have == want:
                # katamgr's own label, set before it kept a record of it: no other writer puts
                # it on a Node (kata-deploy labels its objects with it), so it is adopted.
                keep[key] = want
            elif have != want:
                who = "GFD or NFD?" if key in gpulabels.KEYS else "not katamgr"
                warnings.append(f"node label {key}={have} is set by someone else ({who}); katamgr "
                                f"finds {want} and leaves it")
    return patch, keep, warnings


def kata_label(found: KataOnNode | None) -> dict[str, str]:
    """The Kata release label where containerd has Kata runtimes and their release is known
    (none otherwise: a label katamgr set comes off); ``found``: the node context's."""
    release = release_json(found.release) if found is not None and found.runtimes else None
    return {gpulabels.KATA_RELEASE: release} if release else {}


def publish(host: HostRoot, inventory: Inventory, naming: Naming, node: NodeLabels,
            kata_found: KataOnNode | None = None) -> Report:
    """Make the Node carry the GPU labels and the Kata release label (from ``kata_found``, the
    Kata the node's context found); one patch, and only when something differs."""
    report = Report()
    wanted = {**gpulabels.node_gpu_labels(host, inventory, naming.pci_ids).labels, **kata_label(kata_found)}
    keys = gpulabels.RECORDED_KEYS
    owned = gpulabels.recorded(host)
    try:
        patch, keep, warnings = _decide(wanted, node.read(), owned, keys)
        if (patch or keep != owned) and node.read_fresh is not None:
            # Something to do by the watch's copy: decide on the Node as it is now.
            patch, keep, warnings = _decide(wanted, node.read_fresh(), owned, keys)
    except GpuNodeError as exc:
        report.failures.append(f"cannot read the node's labels for the GPU labels: {exc}")
        return report
    report.warnings += warnings
    if keep != owned or patch:
        # The record first: a revert after a crash between the two still finds what was set.
        gpulabels.record(host, {**owned, **keep})
    if patch:
        try:
            node.patch(patch)
        except GpuNodeError as exc:
            report.failures.append(f"cannot set the node labels: {exc}")
            return report
        report.changes.append("node labels " + ", ".join(
            f"{k}={v}" if v is not None else f"{k} removed" for k, v in patch.items()))
    gpulabels.record(host, keep)
    return report


def revert(host: HostRoot, node: NodeLabels | None) -> Report:
    """Remove the node labels katamgr set (the GPU labels, the Kata release; those still holding
    its value). Without a cluster
    to ask, or when the API refuses, a warning (a label never holds back the devices'
    revert) and the record stays for the next revert."""
    report = Report()
    owned = gpulabels.recorded(host)
    if not owned:
        return report
    if node is None:
        report.warnings.append(f"katamgr set the node labels {', '.join(sorted(owned))}: revert again with a node "
                               "name (--node-name or NODE_NAME) and a cluster to remove them")
        return report
    try:
        current = dict(node.read())
        gone = {k: None for k, v in owned.items() if current.get(k) == v}
        if gone:
            node.patch(dict(gone))
    except GpuNodeError as exc:
        report.warnings.append(f"could not remove the GPU labels katamgr set ({exc}); a later revert tries again")
        return report
    if gone:
        report.changes.append(f"removed node labels {', '.join(sorted(gone))}")
    left = sorted(set(owned) - set(gone))
    if left:
        report.warnings.append(f"node labels {', '.join(left)} were changed by someone else since: left")
    gpulabels.forget(host)
    return report


def plan_section(host: HostRoot, inventory: Inventory, naming: Naming, *, enabled: bool = True) -> PlanSection:
    facts = gpulabels.node_gpu_labels(host, inventory, naming.pci_ids)
    data = {**facts.to_json(), "enabled": enabled}
    lines = [f"{k}={v}   ({facts.sources.get(k, '')})" for k, v in facts.labels.items()]
    if not facts.labels:
        lines.append("none: no NVIDIA GPU on this node")
    if not enabled:
        lines.append("not published (--no-gpu-labels)")
    lines += [f"note: {n}" for n in facts.notes]
    return PlanSection("gpu_labels", "GPU labels for the Node (GFD's names, from pci.ids and sysfs)", data, lines)
