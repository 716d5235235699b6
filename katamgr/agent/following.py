"""The Node the agent follows: its labels, kept by a watch, and the rule that turns them
into a workload and opt-outs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpunode.policy.split import SplitPool
from gpunode.policy.workload import AUTO, Resolution, Workload, resolve_workload
from gpunode.services.kube import NodeLabelWatch


@dataclass(frozen=True)
class NodeFollower:
    read: Callable[[], Resolution]  # the node's workload and opt-outs, from the watch's labels
    watch: NodeLabelWatch  # not started yet


def node_follower(
    api: object | None, node_name: str | None, *, workload: str, default_workload: str | None,
    fallback: Callable[[], tuple[Workload, str]], splits: Sequence[SplitPool] = (),
) -> NodeFollower | None:
    """What ``katamgr run`` follows; None (not followed) without ``--workload auto``, a node
    name or a cluster. ``fallback``: the workload when the labels name none and no default
    is given."""
    if workload != AUTO or not node_name or api is None:
        return None
    watch = NodeLabelWatch(api, node_name)

    def read() -> Resolution:
        return resolve_workload(node_name, lambda node: watch.labels(), default=default_workload,
                                fallback=fallback, splits=splits)

    return NodeFollower(read, watch)
