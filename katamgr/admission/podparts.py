"""The parts of a Pod (the dict the API server sends) the admission rules look at: its
containers of every kind, what each requests, its env, its volumes and mounts, its CDI
annotations. Pure functions; nothing here decides.

A request counts when its quantity is not zero (in ``requests`` or ``limits``); a quantity
that cannot be parsed counts too (the safe side).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
VOID = "void"
# The Pod's container lists, in the order the kubelet starts them. Ephemeral containers come
# only through the pods/ephemeralcontainers subresource (kubectl debug).
CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")
EPHEMERAL = "ephemeralContainers"
_KIND_WORDS = {"initContainers": "init container", "containers": "container",
               "ephemeralContainers": "ephemeral container"}
_QUANTITY = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*$")

# Pod annotations the container runtimes read CDI device names from: containerd's and CRI-O's
# `cdi.k8s.io/` (the CDI spec's annotation convention, tags.cncf.io/container-device-interface
# pkg/cdi/annotations.go) and the NVIDIA Container Toolkit's `nvidia.cdi.k8s.io/`.
CDI_ANNOTATION_PREFIXES = ("cdi.k8s.io/", "nvidia.cdi.k8s.io/")
# Host paths that show GPU device nodes: /dev/nvidia0, nvidiactl, nvidia-uvm, nvidia-caps/...,
# the VFIO group nodes of passthrough GPUs, and the directories above them.
GPU_DEVICE_PREFIXES = ("/dev/nvidia", "/dev/vfio/")
GPU_DEVICE_PATHS = ("/", "/dev", "/dev/vfio")
# The NVIDIA Container Toolkit's volume-mounts device list: a mount whose destination is under
# this directory names a GPU to give the container (`accept-nvidia-visible-devices-as-volume-
# mounts`); /var/run is /run on every distribution the toolkit supports.
DEVICE_LIST_DIRS = ("/var/run/nvidia-container-devices", "/run/nvidia-container-devices")


@dataclass(frozen=True)
class Container:
    """One container of a Pod, where it sits, and the dict itself."""

    list_name: str  # initContainers, containers or ephemeralContainers
    index: int
    spec: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.spec.get("name", ""))

    @property
    def where(self) -> str:
        return f'{_KIND_WORDS[self.list_name]} "{self.name}"'

    @property
    def env(self) -> list[Any]:
        env = self.spec.get("env")
        return env if isinstance(env, list) else []

    def requests(self) -> list[str]:
        """Every resource this container requests or limits to a non-zero quantity, once each."""
        resources = _dict(self.spec.get("resources"))
        seen: list[str] = []
        for part in ("limits", "requests"):
            for resource, quantity in _dict(resources.get(part)).items():
                if resource not in seen and nonzero(quantity):
                    seen.append(str(resource))
        return seen

    def claims(self) -> list[str]:
        """The ResourceClaims (DRA) this container uses, by their name in the pod."""
        claims = _dict(self.spec.get("resources")).get("claims")
        return [str(_dict(c).get("name", "")) for c in claims] if isinstance(claims, list) else []

    def visible_devices(self) -> list[tuple[int, dict[str, Any]]]:
        """Its own NVIDIA_VISIBLE_DEVICES entries (index in env, entry)."""
        return [(i, e) for i, e in enumerate(self.env) if isinstance(e, dict) and e.get("name") == VISIBLE_DEVICES]

    def mounts(self) -> list[dict[str, Any]]:
        mounts = self.spec.get("volumeMounts")
        return [m for m in mounts if isinstance(m, dict)] if isinstance(mounts, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def spec_of(pod: dict[str, Any]) -> dict[str, Any]:
    return _dict(pod.get("spec"))


def containers(pod: dict[str, Any], lists: tuple[str, ...] = CONTAINER_LISTS) -> Iterator[Container]:
    spec = spec_of(pod)
    for list_name in lists:
        items = spec.get(list_name)
        for index, item in enumerate(items if isinstance(items, list) else []):
            if isinstance(item, dict):
                yield Container(list_name, index, item)


def nonzero(quantity: Any) -> bool:
    if isinstance(quantity, bool):
        return True
    if isinstance(quantity, int | float):
        return quantity != 0
    match = _QUANTITY.match(str(quantity))
    if not match:
        return True
    try:
        return Decimal(match.group(1)) != 0
    except InvalidOperation:
        return True


def pod_name(pod: dict[str, Any]) -> str:
    meta = _dict(pod.get("metadata"))
    if meta.get("name"):
        return str(meta["name"])
    if meta.get("generateName"):
        return f"{meta['generateName']}*"
    return "(unnamed)"


def annotations(pod: dict[str, Any] | None) -> dict[str, Any]:
    return _dict(_dict(_dict(pod).get("metadata")).get("annotations"))


def cdi_annotations(pod: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(annotation, device kind) for every CDI device name a pod annotation carries. A value
    is a comma-separated list of qualified names, ``vendor.com/class=device``."""
    for key, value in annotations(pod).items():
        if not str(key).startswith(CDI_ANNOTATION_PREFIXES):
            continue
        for name in str(value).split(","):
            yield str(key), name.split("=", 1)[0].strip()


def canonical(path: str) -> str:
    """A path with empty and ``.`` segments dropped, as the kernel resolves it; the policy's CEL
    does the same. A path with ``..`` is refused before this is asked (hostpaths)."""
    return "/" + "/".join(s for s in path.split("/") if s not in ("", "."))


def holds_gpu_devices(host_path: str) -> bool:
    """Whether a hostPath volume of this path shows GPU device nodes: the nodes themselves,
    a directory of them, or a directory above them (``/dev``, ``/``)."""
    path = canonical(host_path)
    return path in GPU_DEVICE_PATHS or path.startswith(GPU_DEVICE_PREFIXES)


def is_device_list_mount(mount_path: str) -> bool:
    """Whether a container mount at this path is read by the toolkit as a GPU device list."""
    path = canonical(mount_path)
    return any(path == d or path.startswith(d + "/") for d in DEVICE_LIST_DIRS)


def host_paths(pod: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(volume name, host path) of every hostPath volume."""
    volumes = spec_of(pod).get("volumes")
    for volume in volumes if isinstance(volumes, list) else []:
        host_path = _dict(_dict(volume).get("hostPath"))
        if "path" in host_path:
            yield str(_dict(volume).get("name", "")), str(host_path["path"])
