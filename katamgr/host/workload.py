"""The node's workload: which of the GPU Operator's modes a GPU node runs.

The node label ``nvidia.com/gpu.workload.config`` names it: ``container`` (ordinary
GPU containers), ``vm-passthrough`` (whole GPUs passed to Kata VMs) or ``vm-vgpu``
(served by NVIDIA's vGPU stack, not by this project). ``katamgr --workload auto``
and ``sandbox-device-plugin --mode auto`` both decide here, by one rule
(``resolve_workload``):

1. when a node name is known and there is a cluster to ask, the node's label;
2. a node without the label runs the default workload (``--default-workload``);
3. with no node name or no cluster credentials, nothing says what the node runs
   and the command's own fallback decides (``katamgr``: ``vm-passthrough``, it is
   run by hand to set the node up; the device plugin: what the host shows);
4. a label value that is not a workload mode is bad configuration
   (``ConfigError``, exit code 2) and a cluster that was asked but did not answer
   a failure (``KatamgrError``, exit code 1): neither is papered over by a guess.

The cluster is reached only through the ``read_label`` function the caller
passes in, so this module needs no Kubernetes client.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from katamgr.errors import ConfigError, KatamgrError

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


class NoCluster(Exception):
    """Raised by a ``read_label`` function when there is no cluster to ask
    (no in-cluster credentials, no kubeconfig): the fallback decides."""


@dataclass(frozen=True)
class Resolution:
    """The workload ``auto`` resolved to, and why, in a sentence for the log."""

    workload: Workload
    why: str


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
    read_label: Callable[[str], str | None] | None,
    *,
    default: Workload | str | None,
    fallback: Callable[[], tuple[Workload, str]],
) -> Resolution:
    """Resolve ``auto`` by the rule in this module's docstring.

    ``read_label(node_name)`` returns the node's label value (None when unset),
    raises ``NoCluster`` when there is no cluster to ask, and anything else when
    the cluster did not answer; ``read_label=None`` means no cluster to ask.
    ``default`` is ``--default-workload`` (None: the fallback decides for an
    unlabeled node too). ``fallback()`` returns the command's own choice and why;
    it is called only when needed (the device plugin scans the host for it).
    """
    if not node_name:
        return _fall_back(fallback, "no --node-name or NODE_NAME to read the node label")
    if read_label is None:
        return _fall_back(fallback, f"no cluster to ask for node {node_name}'s label {WORKLOAD_LABEL}")
    try:
        value = read_label(node_name)
    except NoCluster as exc:
        return _fall_back(fallback, f"no cluster to ask for node {node_name}'s label {WORKLOAD_LABEL} ({exc})")
    except KatamgrError:
        raise
    except Exception as exc:  # any client failure: the cluster was asked and did not answer
        raise KatamgrError(
            f"could not read node {node_name}'s label {WORKLOAD_LABEL} ({type(exc).__name__}: {exc}); "
            "check that the API server is reachable and that this service account may get nodes"
        ) from exc
    workload = workload_from_label(node_name, value)
    if workload is not None:
        return Resolution(workload, f"node {node_name} is labeled {WORKLOAD_LABEL}={workload}")
    if default is not None:
        return Resolution(Workload(default), f"node {node_name} has no {WORKLOAD_LABEL} label; "
                                             f"--default-workload is {Workload(default)}")
    return _fall_back(fallback, f"node {node_name} has no {WORKLOAD_LABEL} label")


def _fall_back(fallback: Callable[[], tuple[Workload, str]], why: str) -> Resolution:
    workload, how = fallback()
    return Resolution(workload, f"{why}; {how}")
