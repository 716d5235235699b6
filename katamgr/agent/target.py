"""What the agent keeps the node at, the one state every module of the agent shares."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpunode.host.root import HostRoot
from gpunode.policy.inventory import Inventory, discover
from gpunode.policy.katadetect import KataOnNode
from gpunode.policy.naming import Naming
from gpunode.policy.workload import Operand
from gpunode.services.nvlinkfabric import FabricSettings
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.plan import Plan
from katamgr.pipeline.reconcile import DEFAULT_LOCK_WAIT, Steps, full_plan


@dataclass
class Target:
    """The node, the steps kept on it and how each reconcile runs. Only a workload switch
    changes ``steps`` and ``opted_out``."""

    host: HostRoot
    naming: Naming
    # What the command line asks for; the node's opt-outs take parts away (steps).
    base_steps: Steps
    ctx: KataContext | None
    opted_out: frozenset[Operand] = frozenset()
    force: bool = False
    wait: float = 5.0
    lock_wait: float = DEFAULT_LOCK_WAIT
    # The NVLink fabric settings (an NVSwitch board's model: docs/devices.md); None: not looked at.
    fabric: FabricSettings | None = None
    # The Kata runtimes found on the node (the node's context's; the agent's ``KataFound``
    # follows them, with ``naming``); None: not looked for.
    kata_found: KataOnNode | None = None
    steps: Steps = field(init=False)
    # Whether a reconcile or a switch of this agent's has set the node's GPUs: until then,
    # GPUs katamgr's records list against the node's wish were left by a relabel while no
    # agent ran, which is told as the switch it was.
    settled: bool = False

    def __post_init__(self) -> None:
        self.opted_out = frozenset(self.opted_out)
        self.steps = self.base_steps.without(self.opted_out)

    @property
    def binds(self) -> bool:
        """Whether the node wants katamgr's GPUs on vfio-pci now."""
        return self.steps.passthrough and self.steps.vfio

    @property
    def gives_back(self) -> bool:
        """Whether katamgr binds GPUs here at all (no --no-vfio) but the node wants none bound."""
        return self.base_steps.vfio and not self.binds

    def scan(self) -> Inventory:
        return discover(self.host, self.naming.selection, self.naming.nvswitch_rule)

    def plan(self, steps: Steps | None = None) -> Plan:
        """The devices' plan (read-only), without the Kata sections."""
        return full_plan(self.host, self.naming, self.steps if steps is None else steps, None, force=self.force,
                         kata_found=self.kata_found)
