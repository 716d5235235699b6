"""The pod rules of ``katamgr webhook``: pure functions of a Pod (the dict the API server
sends), the subresource under review and a ``Policy``. Each container is judged on its own.

- **GPU resources**: the container GPU names of NVIDIA's device plugin (``nvidia.com/gpu``,
  ``nvidia.com/gpu.shared``, ``nvidia.com/mig-*``) and every passthrough resource. A
  container that uses a ResourceClaim (DRA) may be given a GPU through it, so it counts as
  asking for one.
- **Passthrough resources**: the resources matching the policy's patterns (default every
  ``nvidia.com/*`` extended resource) that are not container GPU names, e.g. what
  sandbox-device-plugin advertises (``nvidia.com/GA102GL_A10``, ``nvidia.com/pgpu``,
  ``nvidia.com/nvswitch``).
- **mutate**: every container, init container and (through ``pods/ephemeralcontainers``,
  ``kubectl debug``) ephemeral container that asks for no GPU gets
  ``NVIDIA_VISIBLE_DEVICES=void`` (replacing what it set), so the NVIDIA container runtime
  hides every GPU from it even where the toolkit honours the variable; a container that
  asks for GPUs loses a ``NVIDIA_VISIBLE_DEVICES`` of its own, which would otherwise win over
  the device plugin's (the kubelet puts a container's env after the device plugin's:
  ``kubelet_pods.go`` GenerateRunContainerOptions). With ``inject_runtime_class``, a pod
  requesting a passthrough resource and no runtime class gets the first Kata class.
- **validate**, in this order (the first problem is the answer, as the admission policy's
  first failing validation is): a passthrough resource without a runtime class; a
  confidential class asking for a GPU model with no CC mode; a class that is neither one of
  the policy's named classes with a Kata handler nor any class whose handler is a Kata GPU
  runtime's (``kata-qemu-nvidia-gpu*``: kata-deploy's and katamgr's, TDX and runtime-rs
  included), judged by its handler where the webhook can read RuntimeClasses (by its name
  otherwise); a CDI annotation naming a GPU
  (``cdi.k8s.io/*``, ``nvidia.cdi.k8s.io/*``); a hostPath with a ``..`` segment; a hostPath
  volume showing GPU device nodes (``/dev/nvidia*``, ``/dev/vfio``, or ``/dev``, ``/``); a
  hostPath at, under or above a GPU control point of the node (``hostpaths``); a mountPath
  or subPath with a ``..`` segment; a mount where the toolkit reads its device list
  (``/var/run/nvidia-container-devices``); a container's own ``NVIDIA_VISIBLE_DEVICES`` that
  mutate would have removed or voided (so the rule holds where only the policy runs).

On ``pods/ephemeralcontainers`` only the ephemeral containers are looked at (the rest of the
pod cannot change there); mutate touches only those the update adds, since the API server
refuses a change to an ephemeral container that already exists. On a plain pod UPDATE
(``validate_update``) only the CDI annotations it adds or changes; mutate never patches one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from gpunode.k8snames import NVIDIA_CONTAINER_RESOURCES
from gpunode.kataclasses import (
    KATA_GPU_HANDLERS,
    KATA_HANDLERS,
    PASSTHROUGH_RUNTIME_CLASSES,
    confidential_by_name,
    not_cc_capable_model,
)
from katamgr.admission import hostpaths
from katamgr.admission.draclaims import DraChecks
from katamgr.admission.podparts import (
    EPHEMERAL,
    VISIBLE_DEVICES,
    VOID,
    Container,
    annotations,
    cdi_annotations,
    containers,
    holds_gpu_devices,
    host_paths,
    is_device_list_mount,
    pod_name,
    spec_of,
)

CONTAINER_GPU_RESOURCES = NVIDIA_CONTAINER_RESOURCES
# The Kata GPU classes a passthrough pod may use when none are named: the agent's, and
# kata-deploy's (TDX and runtime-rs included; gpunode.kataclasses).
DEFAULT_RUNTIME_CLASSES = PASSTHROUGH_RUNTIME_CLASSES
DEFAULT_PASSTHROUGH = ("nvidia.com/*",)
# The handlers of Kata's shims (gpunode.kataclasses).
DEFAULT_KATA_HANDLERS = KATA_HANDLERS
# The handlers of Kata's NVIDIA GPU runtimes (gpunode.kataclasses): a RuntimeClass with one of
# them takes a passthrough pod whatever its name.
DEFAULT_GPU_HANDLERS = KATA_GPU_HANDLERS
EPHEMERAL_SUBRESOURCE = "ephemeralcontainers"
# Every device kind of NVIDIA's CDI specs (nvidia.com/gpu, nvidia.com/pgpu, nvidia.com/nvswitch,
# a passthrough resource's kind) whatever the policy's passthrough patterns say.
NVIDIA_CDI_VENDOR = "nvidia.com/"

__all__ = ["DEFAULT_GPU_HANDLERS", "DEFAULT_PASSTHROUGH", "DEFAULT_RUNTIME_CLASSES", "Policy", "mutate", "pod_name",
           "validate", "validate_update"]


@dataclass(frozen=True)
class Policy:
    runtime_classes: tuple[str, ...] = DEFAULT_RUNTIME_CLASSES
    passthrough: tuple[str, ...] = DEFAULT_PASSTHROUGH  # fnmatch patterns
    inject_runtime_class: bool = False
    # Classes marked confidential besides those named *-snp and *-tdx.
    confidential_classes: tuple[str, ...] = ()
    kata_handlers: tuple[str, ...] = DEFAULT_KATA_HANDLERS  # fnmatch patterns
    # A class not in runtime_classes is taken when its handler matches one of these.
    gpu_handlers: tuple[str, ...] = DEFAULT_GPU_HANDLERS  # fnmatch patterns
    # The handler of a RuntimeClass by name (None: no such class), where the webhook can read
    # them; without it the handler rule is the admission policy's alone.
    handler_of: Callable[[str], str | None] | None = None
    # Passthrough GPUs through DRA claims (draclaims), where the webhook reads claims.
    dra: DraChecks | None = None
    # The node paths no pod's hostPath may reach (hostpaths.control_points: the kubelet's
    # dirs below its root dir too).
    control_points: tuple[str, ...] = hostpaths.CONTROL_POINTS

    def is_confidential(self, runtime_class: str | None) -> bool:
        return bool(runtime_class) and (runtime_class in self.confidential_classes
                                        or confidential_by_name(runtime_class))

    def is_container_gpu(self, resource: str) -> bool:
        return any(fnmatchcase(resource, p) for p in CONTAINER_GPU_RESOURCES)

    def is_passthrough(self, resource: str) -> bool:
        return (not self.is_container_gpu(resource)
                and any(fnmatchcase(resource, p) for p in self.passthrough))

    def is_gpu(self, resource: str) -> bool:
        return self.is_container_gpu(resource) or self.is_passthrough(resource)

    def asks_for_gpu(self, container: Container) -> bool:
        return bool(container.claims()) or any(self.is_gpu(r) for r in container.requests())

    def names_gpu(self, cdi_kind: str) -> bool:
        return cdi_kind.startswith(NVIDIA_CDI_VENDOR) or self.is_gpu(cdi_kind)

    def is_kata_handler(self, handler: str) -> bool:
        return any(fnmatchcase(handler, p) for p in self.kata_handlers)

    def is_gpu_handler(self, handler: str) -> bool:
        return any(fnmatchcase(handler, p) for p in self.gpu_handlers)

    def kata_classes(self) -> str:
        """The classes a passthrough pod may use, in a sentence."""
        named = f", or one of {', '.join(self.runtime_classes)}" if self.runtime_classes else ""
        return f"a Kata GPU class (its handler {' or '.join(self.gpu_handlers)}{named})"


def _scope(subresource: str) -> tuple[str, ...]:
    if subresource == EPHEMERAL_SUBRESOURCE:
        return (EPHEMERAL,)
    return ("initContainers", "containers", EPHEMERAL)


def _void_env(c: Container) -> list[dict[str, Any]]:
    base = f"/spec/{c.list_name}/{c.index}/env"
    wanted = {"name": VISIBLE_DEVICES, "value": VOID}
    if not c.env:
        return [{"op": "add", "path": base, "value": [wanted]}]
    hits = c.visible_devices()
    if not hits:
        return [{"op": "add", "path": f"{base}/-", "value": wanted}]
    (first, entry), *rest = hits
    # Later duplicates first, so the indices of the earlier ones stay right.
    ops: list[dict[str, Any]] = [{"op": "remove", "path": f"{base}/{i}"} for i, _ in reversed(rest)]
    if entry != wanted:
        ops.append({"op": "replace", "path": f"{base}/{first}", "value": wanted})
    return ops


def _drop_env(c: Container) -> list[dict[str, Any]]:
    base = f"/spec/{c.list_name}/{c.index}/env"
    return [{"op": "remove", "path": f"{base}/{i}"} for i, _ in reversed(c.visible_devices())]


def mutate(pod: dict[str, Any], policy: Policy, *, subresource: str = "",
           old: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The JSONPatch for a pod (empty when nothing changes)."""
    existing = ({c.name for c in containers(old, (EPHEMERAL,))}
                if old and subresource == EPHEMERAL_SUBRESOURCE else set())
    ops: list[dict[str, Any]] = []
    for c in containers(pod, _scope(subresource)):
        if c.list_name == EPHEMERAL and c.name in existing:
            continue
        ops += _drop_env(c) if policy.asks_for_gpu(c) else _void_env(c)
    spec = spec_of(pod)
    if (not subresource and policy.inject_runtime_class and policy.runtime_classes
            and not spec.get("runtimeClassName") and _passthrough(pod, policy)):
        ops.append({"op": "add", "path": "/spec/runtimeClassName", "value": policy.runtime_classes[0]})
    return ops


def _passthrough(pod: dict[str, Any], policy: Policy) -> list[tuple[Container, str]]:
    return [(c, r) for c in containers(pod) for r in c.requests() if policy.is_passthrough(r)]


def validate(pod: dict[str, Any], policy: Policy, *, subresource: str = "") -> str | None:
    """Why the pod is denied, or None when it is allowed."""
    problem = None if subresource else (_kata_problem(pod, policy) or _cdi_problem(pod, policy)
                                        or hostpaths.backstep_volume_problem(pod)
                                        or _host_path_problem(pod)
                                        or hostpaths.control_point_problem(pod, policy.control_points))
    scope = _scope(subresource)
    problem = (problem or hostpaths.backstep_mount_problem(pod, scope) or _mount_problem(pod, scope)
               or _env_problem(pod, policy, scope))
    return f'pod "{pod_name(pod)}": {problem}' if problem else None


def validate_update(pod: dict[str, Any], old: dict[str, Any] | None, policy: Policy) -> str | None:
    """Why a plain pod UPDATE is denied, or None. Only its CDI annotations can give it a GPU
    now: the kubelet builds each new sandbox of the pod from its annotations of the time
    (kuberuntime_sandbox.go generatePodSandboxConfig: newPodAnnotations(pod)), and the spec
    the other rules judge cannot change there. An annotation added, or changed to name a GPU,
    is refused; one left as it was, or removed, is not (controllers update pods all the time)."""
    problem = _cdi_problem(pod, policy, before=annotations(old))
    return f'pod "{pod_name(pod)}": {problem}' if problem else None


def _kata_problem(pod: dict[str, Any], policy: Policy) -> str | None:
    """A passthrough pod's class must be one of the named classes with a Kata handler, or any
    class whose handler is a Kata GPU runtime's (the classes kata-deploy or katamgr made on
    this cluster, whatever their names). Without the handlers (no --check-handlers) a class
    is taken by its name: kata-deploy names each class after its handler."""
    passthrough = _passthrough(pod, policy)
    if not passthrough:
        return None
    runtime_class = spec_of(pod).get("runtimeClassName")
    first, resource = passthrough[0]
    more = f" (and {len(passthrough) - 1} more passthrough request(s))" if len(passthrough) > 1 else ""
    asks = f"{first.where} requests the passthrough resource {resource}{more}, but "
    use = (f"; a passthrough GPU is only given to a Kata VM: set spec.runtimeClassName to "
           f"{policy.kata_classes()}, or request nvidia.com/gpu for a container GPU")
    if not runtime_class:
        return asks + "it sets no runtimeClassName" + use
    if not isinstance(runtime_class, str):  # never from the API server, whose decoding refuses it
        return asks + "its runtimeClassName is not a string" + use
    problem = _confidential_problem(runtime_class, passthrough, policy)
    if problem or runtime_class in policy.runtime_classes:
        return problem or _handler_problem(runtime_class, policy)
    if policy.handler_of is None:
        return None if policy.is_gpu_handler(runtime_class) else (
            asks + f'runtimeClassName is "{runtime_class}"' + use)
    handler = policy.handler_of(runtime_class)
    if handler is None or policy.is_gpu_handler(handler):
        return None  # no such class: the API server's RuntimeClass admission refuses the pod
    return (asks + f'runtimeClassName "{runtime_class}" has handler "{handler}", which is not a '
            f"Kata GPU runtime" + use)


def _confidential_problem(runtime_class: str, passthrough: list[tuple[Container, str]],
                          policy: Policy) -> str | None:
    """A confidential class asking for a GPU model that never runs in CC mode: its VM's
    attestation of the GPU can never succeed, so the pod is refused now rather than left
    Pending for good."""
    if not policy.is_confidential(runtime_class):
        return None
    for container, resource in passthrough:
        model = not_cc_capable_model(resource)
        if model:
            return (f'{container.where} requests {resource}, but runtimeClassName "{runtime_class}" runs '
                    f"confidential VMs and the GPU model {model} has no confidential-computing mode "
                    f"(Hopper and later only); use a non-confidential Kata class for it, or request a "
                    f"CC-capable GPU")
    return None


def _handler_problem(runtime_class: str, policy: Policy) -> str | None:
    """A class of the allowed name whose handler is not Kata's (deleted and made again with
    handler runc, say) would give the VFIO device to an ordinary container."""
    if policy.handler_of is None:
        return None
    handler = policy.handler_of(runtime_class)
    if handler is None or policy.is_kata_handler(handler):
        return None  # no such class: the API server's RuntimeClass admission refuses the pod
    return (f'runtimeClassName "{runtime_class}" has handler "{handler}", which is not a Kata '
            f"runtime; a passthrough GPU is only given to a Kata VM: recreate the RuntimeClass with "
            f"its Kata handler (helm upgrade restores it)")


def _cdi_problem(pod: dict[str, Any], policy: Policy, before: dict[str, Any] | None = None) -> str | None:
    now = annotations(pod)
    for annotation, kind in cdi_annotations(pod):
        if before is not None and annotation in before and before[annotation] == now[annotation]:
            continue  # as it was before this update
        if policy.names_gpu(kind):
            return (f'annotation "{annotation}" names the CDI device kind {kind}; a pod gets GPUs by '
                    f"requesting a resource (nvidia.com/gpu, or a passthrough resource in a Kata "
                    f"runtime class), never by a CDI annotation, which the scheduler does not count: "
                    f"remove the annotation")
    return None


def _host_path_problem(pod: dict[str, Any]) -> str | None:
    for volume, path in host_paths(pod):
        if holds_gpu_devices(path):
            return (f'volume "{volume}" is the host path {path}, which shows the node\'s GPU device nodes '
                    f"(/dev/nvidia*, /dev/vfio); request a GPU resource instead ({hostpaths.NODE_SOFTWARE})")
    return None


def _mount_problem(pod: dict[str, Any], scope: tuple[str, ...]) -> str | None:
    for c in containers(pod, scope):
        for mount in c.mounts():
            path = str(mount.get("mountPath", ""))
            if is_device_list_mount(path):
                return (f'{c.where} mounts volume "{mount.get("name", "")}" at {path}, where the NVIDIA '
                        f"container runtime reads which GPUs to give the container; request a GPU "
                        f"resource instead ({hostpaths.NODE_SOFTWARE})")
    return None


def _env_problem(pod: dict[str, Any], policy: Policy, scope: tuple[str, ...]) -> str | None:
    for c in containers(pod, scope):
        own = c.visible_devices()
        if not own:
            continue
        if policy.asks_for_gpu(c):
            return (f"{c.where} sets {VISIBLE_DEVICES} itself, which would override the GPUs the device "
                    f"plugin gives it (the kubelet puts a container's env after the device plugin's): "
                    f"remove it")
        if any(entry != {"name": VISIBLE_DEVICES, "value": VOID} for _, entry in own):
            return (f'{c.where} requests no GPU but sets {VISIBLE_DEVICES} to something other than '
                    f'"{VOID}"; a container that requests no GPU resource sees no GPU: remove it, or '
                    f"request the GPU it needs ({hostpaths.NODE_SOFTWARE})")
    return None
