"""The node's workload: which of the GPU Operator's modes a GPU node runs.

The node label ``nvidia.com/gpu.workload.config`` names it: ``container`` (ordinary
GPU containers), ``vm-passthrough`` (whole GPUs passed to Kata VMs) or ``vm-vgpu``
(served by NVIDIA's vGPU stack, not by this project). ``katamgr --workload auto``
and ``sandbox-device-plugin --workload auto`` both decide here, by one rule
(``resolve_workload``):

1. when a node name is known and there is a cluster to ask, the node's label;
2. a node without the label runs the default workload (``--default-workload``);
3. with no node name or no cluster credentials, nothing says what the node runs
   and the command's own fallback decides (``katamgr``: ``vm-passthrough``, it is
   run by hand to set the node up; the device plugin: what the host shows);
4. a label value that is not a workload mode is bad configuration
   (``ConfigError``, exit code 2) and a cluster that was asked but did not answer
   a failure (``GpuNodeError``, exit code 1): neither is papered over by a guess.

The node also opts out of single components with the GPU Operator's deploy labels
(``opted_out``): the operator's DaemonSets run where ``nvidia.com/gpu.deploy.<operand>``
is ``true`` and an operator sets one to ``false`` to keep that operand off the node
(or ``nvidia.com/gpu.deploy.operands=false`` for all of them). The label names and what
each one starts are the GPU Operator's (NVIDIA/gpu-operator ``controllers/state_manager.go``:
``gpuStateLabels``, ``hasOperandsDisabled``; ``assets/state-*/..._daemonset.yaml``: each
operand's ``nodeSelector``); what our components do for each is ``Operand``'s docstring.

The cluster is reached only through the ``read_labels`` function the caller
passes in, so this module needs no Kubernetes client.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from gpunode.errors import ConfigError, GpuNodeError
from gpunode.policy.split import SplitPool, split_value

WORKLOAD_LABEL = "nvidia.com/gpu.workload.config"
AUTO = "auto"


class Workload(StrEnum):
    CONTAINER = "container"
    VM_PASSTHROUGH = "vm-passthrough"
    VM_VGPU = "vm-vgpu"


WORKLOADS = tuple(w.value for w in Workload)
# The GPU Operator's sandboxWorkloads.defaultWorkload: a node without the label
# runs ordinary containers unless the operator says otherwise.
DEFAULT_WORKLOAD = Workload.CONTAINER


DEPLOY_LABEL_PREFIX = "nvidia.com/gpu.deploy."
# The GPU Operator's switch for every operand of a node at once (commonOperandsLabelKey):
# "false" removes all its deploy labels, so none of its operands runs there.
OPERANDS_LABEL = f"{DEPLOY_LABEL_PREFIX}operands"
OPTED_OUT = "false"


class Operand(StrEnum):
    """The GPU Operator operands this project stands in for, named as in their deploy
    label ``nvidia.com/gpu.deploy.<operand>``, and what ours do when a node sets it ``false``:

    - ``vfio-manager`` (the operator's pod unbinds every GPU in its preStop hook when it
      leaves a node): katamgr binds nothing there and gives back the GPUs it bound that no
      pod or VM holds, as on a switch away from vm-passthrough;
    - ``kata-manager``: katamgr stands down on the Kata runtime (no artifact pulls, no
      containerd edits or drift repairs); the entries it wrote stay for running VMs until
      ``katamgr revert``;
    - ``sandbox-validator`` (writes, and in its preStop removes, the files in
      ``/run/nvidia/validations``): katamgr writes no readiness files there and removes its own;
    - ``sandbox-device-plugin``, ``kata-sandbox-device-plugin`` (the operator's passthrough
      plugin, named for sandboxWorkloads.mode kubevirt or kata): the passthrough plugin
      advertises nothing;
    - ``device-plugin`` (its ``nvidia.com/gpu`` plugin): the container plugin advertises
      nothing (the chart also keeps its container plugin DaemonSet off such a node).
    """

    VFIO_MANAGER = "vfio-manager"
    KATA_MANAGER = "kata-manager"
    SANDBOX_VALIDATOR = "sandbox-validator"
    SANDBOX_DEVICE_PLUGIN = "sandbox-device-plugin"
    KATA_SANDBOX_DEVICE_PLUGIN = "kata-sandbox-device-plugin"
    DEVICE_PLUGIN = "device-plugin"

    @property
    def label(self) -> str:
        return f"{DEPLOY_LABEL_PREFIX}{self.value}"


# The passthrough plugin is either of the operator's two sandbox plugins.
PASSTHROUGH_PLUGIN = frozenset({Operand.SANDBOX_DEVICE_PLUGIN, Operand.KATA_SANDBOX_DEVICE_PLUGIN})


def opted_out(labels: Mapping[str, str]) -> frozenset[Operand]:
    """The operands the node's labels keep off it. Only ``false`` opts out: the GPU
    Operator sets ``true`` on the nodes of each workload and keeps any value an operator
    set (``addGPUStateLabels`` honors an existing non-empty value), and without it nobody
    sets ``true`` at all, so an absent label means: not opted out."""
    if labels.get(OPERANDS_LABEL) == OPTED_OUT:
        return frozenset(Operand)
    return frozenset(op for op in Operand if labels.get(op.label) == OPTED_OUT)


def describe_opt_outs(operands: frozenset[Operand]) -> str:
    return ", ".join(f"{op.label}={OPTED_OUT}" for op in sorted(operands)) or "none"


class NoCluster(Exception):
    """Raised by a ``read_label`` function when there is no cluster to ask
    (no in-cluster credentials, no kubeconfig): the fallback decides."""


@dataclass(frozen=True)
class Resolution:
    """The workload ``auto`` resolved to, and why, in a sentence for the log; and the
    operands the node opts out of (none when no label was read)."""

    workload: Workload
    why: str
    opted_out: frozenset[Operand] = field(default_factory=frozenset)
    # The split label's value (``gpunode.policy.split``): the VM share of a vm-passthrough
    # node's GPUs, the rest for containers; None: no label, every GPU to VMs.
    split: str | None = None
    # Where ``split`` came from: None the label, else the node pool (``split.split_value``).
    split_from: str | None = None


def workload_from_label(node_name: str, value: str | None) -> Workload | None:
    """The workload a label value names; None when the node has no label."""
    if value is None or value == "":
        return None
    try:
        return Workload(value)
    except ValueError:
        raise ConfigError(
            f"node {node_name} has label {WORKLOAD_LABEL}={value!r}, which is not a "
            f"workload mode; set it to one of {', '.join(WORKLOADS)}"
        ) from None


def resolve_workload(
    node_name: str | None,
    read_labels: Callable[[str], Mapping[str, str]] | None,
    *,
    default: Workload | str | None,
    fallback: Callable[[], tuple[Workload, str]],
    splits: Sequence[SplitPool] = (),
) -> Resolution:
    """Resolve ``auto`` by the rule in this module's docstring.

    ``read_labels(node_name)`` returns the node's labels, raises ``NoCluster`` when
    there is no cluster to ask, and anything else when the cluster did not answer;
    ``read_labels=None`` means no cluster to ask.
    ``default`` is ``--default-workload`` (None: the fallback decides for an
    unlabeled node too). ``fallback()`` returns the command's own choice and why;
    it is called only when needed (the device plugin scans the host for it).
    """
    if not node_name:
        return _fall_back(fallback, "no --node-name or NODE_NAME to read the node label")
    if read_labels is None:
        return _fall_back(fallback, f"no cluster to ask for node {node_name}'s label {WORKLOAD_LABEL}")
    try:
        labels = read_labels(node_name)
    except NoCluster as exc:
        return _fall_back(fallback, f"no cluster to ask for node {node_name}'s label {WORKLOAD_LABEL} ({exc})")
    except GpuNodeError:
        raise
    except Exception as exc:  # any client failure: the cluster was asked and did not answer
        raise GpuNodeError(
            f"could not read node {node_name}'s label {WORKLOAD_LABEL} ({type(exc).__name__}: {exc}); "
            "check that the API server is reachable and that this service account may get nodes"
        ) from exc
    workload = workload_from_label(node_name, labels.get(WORKLOAD_LABEL))
    out = opted_out(labels)
    share, pool = split_value(labels, splits)
    if workload is not None:
        return Resolution(workload, f"node {node_name} is labeled {WORKLOAD_LABEL}={workload}", out, share, pool)
    if default is not None:
        return Resolution(Workload(default), f"node {node_name} has no {WORKLOAD_LABEL} label; "
                                             f"--default-workload is {Workload(default)}", out, share, pool)
    fell_back = _fall_back(fallback, f"node {node_name} has no {WORKLOAD_LABEL} label")
    return Resolution(fell_back.workload, fell_back.why, out, share, pool)


def _fall_back(fallback: Callable[[], tuple[Workload, str]], why: str) -> Resolution:
    workload, how = fallback()
    return Resolution(workload, f"{why}; {how}")


def by_hand() -> tuple[Workload, str]:
    """The workload of a node with no cluster to ask: katamgr run by hand, the operator is
    there to set the node up (a ``resolve_workload`` fallback)."""
    return Workload.VM_PASSTHROUGH, "katamgr run by hand sets the node up for it"
