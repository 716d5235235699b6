"""What ``katamgr run`` is told: the node it keeps and how (``AgentSettings``), and the
parts of the cluster it reaches (``NodeLinks``, made by ``agent.build`` from an API client,
or by a test from stand-ins). Typed, so a composition is checked where it is written."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpunode.host.cc import CcMode
from gpunode.host.root import HostRoot
from gpunode.policy.health import DEFAULT_LINK_POLICY
from gpunode.policy.katadetect import KataOnNode
from gpunode.policy.naming import Naming
from gpunode.policy.workload import AUTO, DEFAULT_WORKLOAD, Operand, Resolution, Workload
from gpunode.services.nvlinkfabric import FabricSettings
from katamgr.agent.reconciler import RETRY_INITIAL, RETRY_MAX
from katamgr.pipeline.gpulabels import NodeLabels
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.reconcile import DEFAULT_LOCK_WAIT, Steps

if TYPE_CHECKING:
    from katamgr.agent.katafound import KataFound


@dataclass(frozen=True)
class AgentSettings:
    """The node the agent keeps (``host``, ``naming``, ``steps``, ``ctx``, the operands it
    opts out of at start) and the flags of ``katamgr run``. ``node_name``, ``workload``,
    ``default_workload``, ``follow``, ``gpu_labels`` and ``cc_default_mode`` say what
    ``agent.build`` links to the cluster: the Node followed (``--workload auto``, not
    ``--once``), the GPU labels published, the CC modes kept (None: ``--cc-manager`` off)."""

    host: HostRoot
    naming: Naming
    steps: Steps
    ctx: KataContext | None
    opted_out: frozenset[Operand] = frozenset()
    force: bool = False
    wait: float = 5.0
    lock_wait: float = DEFAULT_LOCK_WAIT
    repull_interval: float = 3600.0
    revert_on_exit: bool = False
    check_interval: float = 10.0
    retry_initial: float = RETRY_INITIAL
    retry_max: float = RETRY_MAX
    metrics_address: str | None = None
    fabric: FabricSettings | None = None
    # The node's health policy (``--link-policy``): the hand-back check judges a GPU's link as
    # the device plugin does, or a GPU it offered would fail between tenants for good.
    link_policy: str = DEFAULT_LINK_POLICY
    # The Kata runtimes the node's context found at start (``NodeContext.kata_found``), and
    # how the agent looks for them again (``kata_found``).
    kata_on_node: KataOnNode | None = None
    kata_found: KataFound | None = None
    cc_default_mode: CcMode | None = None
    node_name: str | None = None
    workload: str = AUTO
    default_workload: str | None = DEFAULT_WORKLOAD.value
    follow: bool = True
    gpu_labels: bool = True
    # ``--offer-gate``: the runtime classes offered only while the kubelet can give the device
    # plugin's devices, and withdrawn first on stop (``agent.offergate``).
    offer_gate: bool = False
    # ``--rejected-pods``: none, or event (``agent.rejected``: each time the offer gate opens,
    # the pods the kubelet refused for our devices before the plugin registered, named on the Node).
    rejected_pods: str = "none"


@dataclass(frozen=True)
class NodeLinks:
    """What the agent reaches outside the node, each None where it has no cluster to reach.

    ``events``: a ``katamgr.cluster.EventRecorder``; ``read_workload``: the node's workload
    and opt-outs now (None: not followed); ``node_watch``: a started
    ``gpunode.services.kube.NodeLabelWatch`` that keeps the labels and wakes the loop when they
    change; ``node_labels``: the Node's labels, to publish the GPU labels on; ``offer_labels``:
    the same, for the runtime classes offered on the node (``pipeline.offers``); the CC modes'
    label reader and publisher and the Node's capacity and allocatable (``read_resources``)."""

    events: Any = None
    read_workload: Callable[[], Resolution | Workload | str] | None = None
    node_watch: Any = None
    node_labels: NodeLabels | None = None
    offer_labels: NodeLabels | None = None
    read_labels: Callable[[], Mapping[str, str]] | None = None
    publish_labels: Callable[[dict[str, str | None]], None] | None = None
    read_resources: Callable[[], tuple[Mapping[str, str], Mapping[str, str]]] | None = None
    # A ``katamgr.agent.conditions.NodeConditions``: the node's state as Node conditions.
    conditions: Any = None
    # The node's Failed pods (``katamgr.cluster.pods.failed_pods_on_node``), for ``--rejected-pods``.
    failed_pods: Callable[[], list] | None = None


NO_CLUSTER = NodeLinks()  # an agent that reaches nothing outside its node
