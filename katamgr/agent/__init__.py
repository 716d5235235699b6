"""``katamgr run``: the node agent.

Reconcile once, then keep the node that way: containerd's config (inotify) and the CDI
specs against the devices on vfio-pci between reconciles, the artifacts on a timer, a
failed reconcile retried with backoff. With ``--metrics-address`` it serves ``/metrics``,
``/healthz`` (the loop ticked recently, or is busy for a bounded time) and ``/readyz``
(the last reconcile succeeded); with a cluster and a node name it records Events on the
Node and follows the Node's labels (the workload and the GPU Operator's opt-outs).

One module per concern, each readable on its own:

- ``build``: ``build(settings, api)``, the ``Agent`` of ``katamgr run`` linked to the cluster;
- ``settings``: ``AgentSettings`` (what ``katamgr run`` is told) and ``NodeLinks`` (what it reaches);
- ``running``: the ``Agent``, these modules wired together; run once or kept running, stopped;
- ``loop``: what runs when, and nothing else (the agent is its ``Kept`` Protocol);
- ``reconciler``: one reconcile (the pipeline's) and its outcome: metrics, Events, backoff;
- ``switch``: the workload switch on a relabel, and a relabel found at start;
- ``giveback``: the GPUs a switch kept on vfio-pci for a VM or pod, given back once free;
- ``drift``: containerd's config and the CDI specs, changed by someone else;
- ``health``, ``metrics``, ``events``: ``/healthz`` and ``/readyz``, ``/metrics``, Node Events;
- ``target``: what the node is kept at, the state these modules share.
- ``planonly``: ``katamgr run --plan-only``, the plan published and never carried out.
"""

from katamgr.agent.metrics import AgentMetrics
from katamgr.agent.running import Agent
from katamgr.agent.settings import AgentSettings, NodeLinks

__all__ = ["Agent", "AgentMetrics", "AgentSettings", "NodeLinks"]
