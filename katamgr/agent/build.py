"""The agent composed: ``build(settings, api)`` links ``AgentSettings`` to the cluster the
API client reaches (None: none) and gives the ``Agent`` that ``katamgr run`` runs.

With a cluster and a node name: Events on the Node, the GPU labels and the offered runtime
classes published on it, and, where asked, the Node followed (``--workload auto``, by one
label watch every module of the agent reads) and the CC modes kept. Without: the agent keeps the node as
the command line says.
"""

from __future__ import annotations

from gpunode.errors import ConfigError
from gpunode.policy.workload import by_hand
from katamgr.agent.following import node_follower
from katamgr.agent.running import Agent
from katamgr.agent.settings import AgentSettings, NodeLinks
from katamgr.pipeline.gpulabels import node_labels


def build(settings: AgentSettings, api: object | None) -> Agent:
    """The agent of ``settings`` on the cluster ``api`` reaches (ConfigError where the CC
    modes are asked for without a node name and a cluster)."""
    node = settings.node_name if api is not None else None
    if settings.cc_default_mode is not None and node is None:
        raise ConfigError("--cc-manager follows the node label nvidia.com/cc.mode: it needs --node-name "
                          "(or NODE_NAME) and a cluster to ask")
    if node is None:
        return Agent(settings)
    from katamgr.agent.conditions import TYPES, NodeConditions
    from katamgr.cluster import EventRecorder, node_resources, set_node_labels
    from katamgr.cluster.conditions import patch_node_conditions, read_node_conditions
    from katamgr.cluster.pods import failed_pods_on_node

    follower = node_follower(api, node, workload=settings.workload,
                             default_workload=settings.default_workload,
                             fallback=by_hand,
                             splits=settings.ctx.config.split_pools if settings.ctx is not None else ()
                             ) if settings.follow else None
    watch = follower.watch if follower is not None else None
    labels = node_labels(api, node, watch)
    cc = {}
    if settings.cc_default_mode is not None:
        cc = {"read_labels": labels.read,
              "publish_labels": lambda patch: set_node_labels(api, node, patch),
              "read_resources": lambda: node_resources(api, node)}
    links = NodeLinks(
        # In "default", the one namespace the API server accepts a Node's Events in (the
        # chart's <release>-node-events Role there lets the agent create them).
        events=EventRecorder(api, node),
        read_workload=follower.read if follower is not None else None,
        node_watch=watch.start() if watch is not None else None,
        node_labels=labels if settings.gpu_labels else None,
        offer_labels=labels if settings.ctx is not None else None,
        conditions=NodeConditions(lambda conditions: patch_node_conditions(api, node, conditions),
                                  lambda: read_node_conditions(api, node, TYPES)),
        failed_pods=(lambda: failed_pods_on_node(api, node)) if settings.rejected_pods != "none" else None,
        **cc,
    )
    return Agent(settings, links)
