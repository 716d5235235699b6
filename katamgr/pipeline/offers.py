"""Which runtime classes this node offers: the per-class node label the RuntimeClasses select.

A RuntimeClass is cluster-wide, but a class can fail on one node (its registry unreachable from
there, say) while the others run. Every class's ``scheduling.nodeSelector`` requires
``kataclasses.offer_label(NAME)=true``, which is set here on the Node where the class is
installed and registered with containerd, and removed where it is not, so the scheduler never
places a pod of that class on a node that cannot start it. A class dropped from the config is
taken out of containerd's config too (``runtime.configure_containerd`` keeps exactly the
configured runtimes of ours), so its label goes as well, though no config names it any more.
One patch, only when a label differs.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpunode.errors import GpuNodeError
from gpunode.kataclasses import OFFER_LABEL_PREFIX, offer_label
from katamgr.pipeline.gpulabels import NodeLabels
from katamgr.pipeline.report import Report


def wanted(configured: Iterable[str], ready: Iterable[str]) -> dict[str, str | None]:
    """Each configured class's label: "true" where it is ready on this node, else removed."""
    ready = set(ready)
    return {offer_label(name): "true" if name in ready else None for name in configured}


def publish(node: NodeLabels, labels: dict[str, str | None]) -> Report:
    """Bring the Node's offer labels to ``labels`` (None removes), removing every other offer
    label (a class no longer configured): one patch, only when needed."""
    report = Report()
    try:
        current = node.read()
        patch = _patch(current, labels)
        if patch and node.read_fresh is not None:  # a watch's copy may lag: ask before writing
            current = node.read_fresh()
            patch = _patch(current, labels)
        if patch:
            node.patch(patch)
    except GpuNodeError as exc:
        report.failures.append(f"{exc}; the runtime classes offered on this node are not up to date")
        return report
    report.offered = {k.removeprefix(OFFER_LABEL_PREFIX): v is not None for k, v in sorted(patch.items())}
    report.changes += [f"offered runtime class {name} on this node ({offer_label(name)}=true)"
                       for name, on in report.offered.items() if on]
    report.changes += [f"stopped offering runtime class {name} on this node (removed {offer_label(name)})"
                       for name, on in report.offered.items() if not on]
    return report


def _patch(current: dict[str, str], labels: dict[str, str | None]) -> dict[str, str | None]:
    """What differs from ``labels``, the offer labels of classes it does not name removed."""
    want = {k: None for k in current if k.startswith(OFFER_LABEL_PREFIX)} | labels
    return {k: v for k, v in want.items() if current.get(k) != v}


def withdraw(node: NodeLabels) -> Report:
    """Remove every offer label from the Node (a revert: no class is installed any more)."""
    try:
        current = node.read()
    except GpuNodeError as exc:
        return Report(failures=[f"{exc}; the node's {OFFER_LABEL_PREFIX}* labels were left"])
    return publish(node, {k: None for k in current if k.startswith(OFFER_LABEL_PREFIX)})
