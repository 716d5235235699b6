"""The Kata runtime classes of the GPU Operator's sandbox stack, by name.

Three parts of the product need the same answer to "which runtime classes are Kata's":
the agent creates these classes by default (``katamgr.config``), the admission layers let a
pod that asks for a passthrough GPU use only them (``katamgr.admission``), and the DRA driver
prepares a claim only for their pods (``sandbox_plugin.dra``). One list here, at the base of
both programs, so that the three cannot drift apart. Admission also takes any class whose
handler is a Kata GPU runtime's (``KATA_GPU_HANDLERS``), whatever its name.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase

GPU = "kata-qemu-nvidia-gpu"
GPU_SNP = "kata-qemu-nvidia-gpu-snp"
GPU_TDX = "kata-qemu-nvidia-gpu-tdx"

# In the order the GPU Operator lists them; the first is the one the webhook injects.
DEFAULT_RUNTIME_CLASSES: tuple[str, ...] = (GPU, GPU_SNP)

# kata-deploy's NVIDIA GPU runtime classes: its shims qemu-nvidia-gpu, -snp and -tdx, for the
# Go shim and runtime-rs (the same with -runtime-rs), each registered as kata-<shim>
# (kata-containers tools/packaging/kata-deploy/binary/src/config.rs shim_handler,
# artifacts/install.rs ALL_SHIMS).
KATA_DEPLOY_GPU_CLASSES: tuple[str, ...] = tuple(
    f"{name}{flavour}" for flavour in ("", "-runtime-rs") for name in (GPU, GPU_SNP, GPU_TDX))

# The classes a passthrough pod may use (admission) and whose pods' claims the DRA driver
# prepares, where nothing names them: the agent's defaults first (the webhook injects the
# first), then the rest of kata-deploy's GPU classes. The agent creates only its defaults.
PASSTHROUGH_RUNTIME_CLASSES: tuple[str, ...] = (
    *DEFAULT_RUNTIME_CLASSES, *(c for c in KATA_DEPLOY_GPU_CLASSES if c not in DEFAULT_RUNTIME_CLASSES))

# The handlers of Kata's NVIDIA GPU runtimes, as globs: kata-deploy registers each of its GPU
# shims (qemu-nvidia-gpu, -snp, -tdx and their -runtime-rs twins) with containerd as
# kata-<shim>, kata-<shim>-<multiInstallSuffix> on a second install and kata-<shim>-debug or
# -devkit for its debug variants, and its RuntimeClasses name that handler (kata-containers
# tools/packaging/kata-deploy/helm-chart/kata-deploy/templates/runtimeclasses.yaml); katamgr's
# own classes have handler = name. Every one starts kata-qemu-nvidia-gpu, and no other shim of
# kata-deploy's does (its CPU one is qemu-nvidia-cpu). A passthrough pod may use any
# RuntimeClass whose handler matches, whatever the class is called.
KATA_GPU_HANDLERS: tuple[str, ...] = (f"{GPU}*",)

# The handlers of Kata's shims (containerd-shim-kata-v2's runtime names: kata, kata-qemu-*,
# kata-clh, kata-qemu-nvidia-gpu-snp ...), as kata-deploy registers them with containerd: a
# class named in the allow-list (a custom Kata runtime) must have one of these.
KATA_HANDLERS: tuple[str, ...] = ("kata", "kata-*")


def kata_gpu_class_problem(name: str, handler: str | None, *, named: tuple[str, ...] | frozenset[str],
                           kata_handlers: tuple[str, ...] = KATA_HANDLERS,
                           gpu_handlers: tuple[str, ...] = KATA_GPU_HANDLERS) -> str | None:
    """Why the RuntimeClass ``name`` with ``handler`` (None: no such class) may not run a
    passthrough GPU's pod, or None when it may: its handler is a Kata GPU runtime's, or the
    class is one of ``named`` and its handler a Kata runtime's. Judged by the handler, never the
    name alone: a class deleted and made again with handler runc is not Kata's whatever its
    name. The one rule the webhook's claim checks and the DRA driver share."""
    if handler is None:
        return f"runtime class {name} does not exist"
    if any(fnmatchcase(handler, p) for p in gpu_handlers):
        return None
    if name in named and any(fnmatchcase(handler, p) for p in kata_handlers):
        return None
    if name in named:
        return (f"runtime class {name} has handler {handler}, which is not a Kata runtime's "
                f"({', '.join(kata_handlers)}): recreate the RuntimeClass with its Kata handler "
                "(helm upgrade restores it)")
    return (f"runtime class {name} has handler {handler}, which is not a Kata GPU runtime's "
            f"({', '.join(gpu_handlers)})")

# Confidential classes: their VMs are AMD SEV-SNP or Intel TDX guests, which need their GPUs
# in CC mode (kata-deploy's qemu-nvidia-gpu-snp and qemu-nvidia-gpu-tdx shims, and their
# -runtime-rs, -debug and multiInstallSuffix variants, which add a part after -snp or -tdx).
# A class the config marks ``confidential`` is one too, whatever its name.
CONFIDENTIAL_PATTERN = r"-(snp|tdx)(-|$)"
_CONFIDENTIAL = re.compile(CONFIDENTIAL_PATTERN)
# The node label NVIDIA's k8s-cc-manager (and katamgr's CC-mode agent) sets "true" once the
# node's GPUs run a confidential mode: what a confidential class schedules by.
CC_READY_LABEL = "nvidia.com/cc.ready.state"


# The node label that offers runtime class NAME on a node: ``runtimeclass.kata-sandbox-manager.io/NAME
# = "true"``, set by the agent once the class is installed and registered with containerd there,
# removed when it is not (its artifacts failed, the node left vm-passthrough, a revert). Every
# RuntimeClass's scheduling.nodeSelector requires it (``RuntimeClassConfig.scheduling_node_selector``
# and the chart's runtimeclasses.yaml), so no pod is scheduled to a node that cannot start it. In
# the style of kata-deploy's katacontainers.io/kata-runtime=true (a node that runs Kata), but under
# our own domain, as our other labels (isolation.kata-sandbox-manager.io/exempt): katacontainers.io
# is the Kata project's. One key per class: a RuntimeClass name is a DNS label (at most 63), which
# fits a label's name part whole.
OFFER_LABEL_PREFIX = "runtimeclass.kata-sandbox-manager.io/"


def offer_label(name: str) -> str:
    return OFFER_LABEL_PREFIX + name


def confidential_by_name(name: str) -> bool:
    return bool(_CONFIDENTIAL.search(name))


# A passthrough resource named after a GPU model of an architecture with no confidential
# computing: the pci.ids name (which both naming rules keep the front of) starts with the
# chip, and a chip before Hopper (Fermi GF, Kepler GK, Maxwell GM, Pascal GP, Volta GV,
# Turing TU, Ampere GA, Ada AD) never has a CC mode (NVIDIA's gpu-admin-tools: CC modes on
# Hopper and later only). The admission layers refuse such a GPU to a confidential class:
# its VM could never attest it. Anything else (a Hopper or Blackwell model, an alias such as
# pgpu, a hex id where pci.ids lacks the model) is left to the scheduler and cc.ready.state.
NOT_CC_CAPABLE_MODEL_PATTERN = r"^nvidia\.com/(GF|GK|GM|GP|GV|TU|GA|AD)[0-9]{3}"
_NOT_CC_CAPABLE = re.compile(NOT_CC_CAPABLE_MODEL_PATTERN)


def not_cc_capable_model(resource: str) -> str | None:
    """The model part of ``resource`` when it names a GPU that can never run a CC mode."""
    if _NOT_CC_CAPABLE.match(resource):
        return resource.split("/", 1)[1]
    return None
