"""Paths in a Pod the admission rules judge: hostPath volumes, and each container's
mountPath and subPath. Pure functions; the chart's admission policy says the same in CEL
(templates/isolation-policy.yaml), so both layers judge every path alike.

How a path is read, in both layers: empty and ``.`` segments are dropped (``//dev/./`` is
``/dev``, a trailing ``/`` goes), and a path with a ``..`` segment is refused outright. CEL
has no path library and no loop that could resolve ``..`` against the segments before it,
and the kernel resolves ``..`` after symlinks on the node, which neither layer sees: so
``..`` is never judged, only refused, with a message saying to write the path without it.
The API server already refuses ``..`` in a hostPath and a subPath
(k8s.io/kubernetes pkg/apis/core/validation: validateHostPathVolumeSource and
ValidateVolumeMounts call validatePathNoBacksteps), but not in a mountPath, which the NVIDIA
Container Toolkit cleans (filepath.Clean, internal/config/image/cuda_image.go
DevicesFromMounts) before it reads a device list from it.

The node's GPU control points: what reaches the GPUs without a ``/dev`` node of them. A
hostPath at or under one, or above one (``/var/lib/kubelet``, ``/run``, ``/sys``, ``/``), is
refused; node software that needs them runs in an exempt namespace.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from katamgr.admission.podparts import Container, canonical, containers, host_paths

# In the order the rules name them (the first a path reaches is the one in the message).
# /var/run is a symlink to /run on the nodes' distributions: both spellings are listed.
CONTROL_POINTS = (
    # The kubelet's device-plugin registration socket and plugins' sockets: a rogue plugin
    # registers nvidia.com/gpu and hands out any GPU.
    "/var/lib/kubelet/device-plugins",
    # The kubelet's pod-resources API: which pod holds which GPU.
    "/var/lib/kubelet/pod-resources",
    # DRA drivers' sockets and their registration (kubelet plugin watcher).
    "/var/lib/kubelet/plugins",
    "/var/lib/kubelet/plugins_registry",
    # CDI spec directories (tags.cncf.io/container-device-interface DefaultSpecDirs, and the
    # NVIDIA toolkit's /var/run/cdi): a rewritten spec gives any container any device node.
    "/etc/cdi",
    "/var/run/cdi",
    "/run/cdi",
    # The container runtimes' sockets: containerd or CRI-O itself starts any container.
    "/run/containerd",
    "/var/run/containerd",
    "/run/crio",
    "/var/run/crio",
    # PCI devices in sysfs: remove, reset, driver_override, bind and unbind, as root.
    "/sys/bus/pci",
    "/sys/devices",
    "/sys/kernel/iommu_groups",
    # Their entries are symlinks into /sys/devices and /sys/bus/pci/drivers, which the
    # kubelet's bind mount of a hostPath follows (/sys/class/drm/card0/device is the GPU's
    # PCI directory, /sys/module/nvidia/drivers/pci:nvidia its driver's).
    "/sys/class",
    "/sys/dev",
    "/sys/module",
    # udev's /dev/char/MAJOR:MINOR symlinks, e.g. to a VFIO group's /dev/vfio/N.
    "/dev/char",
)


def has_backstep(path: str) -> bool:
    """Whether a path has a ``..`` segment (as validatePathNoBacksteps splits it)."""
    return ".." in path.split("/")


# The kubelet's dirs below its --root-dir (kubelet_getters.go getPodResourcesDir, getPluginsDir,
# getPluginsRegistrationDir): control points too where the root dir is not /var/lib/kubelet.
KUBELET_ROOT_DIRS = ("pod-resources", "plugins", "plugins_registry")


def control_points(kubelet_dir: str = "/var/lib/kubelet") -> tuple[str, ...]:
    """CONTROL_POINTS, then the kubelet's own dirs below another root dir (k0s, microk8s)."""
    root = canonical(kubelet_dir).rstrip("/")
    extra = tuple(f"{root}/{d}" for d in KUBELET_ROOT_DIRS)
    return CONTROL_POINTS + tuple(p for p in extra if p not in CONTROL_POINTS)


def control_point_of(host_path: str, points: tuple[str, ...] = CONTROL_POINTS) -> str | None:
    """The first control point a hostPath of this path reaches (at, under or above it)."""
    path = canonical(host_path)
    for point in points:
        if path == "/" or path == point or path.startswith(point + "/") or point.startswith(path + "/"):
            return point
    return None


_NO_BACKSTEPS = ('a path with a ".." segment; the isolation rules judge a path as written, '
                 'dropping "." and empty segments, and never resolve "..": write it without ".."')


def backstep_volume_problem(pod: dict[str, Any]) -> str | None:
    for volume, path in host_paths(pod):
        if has_backstep(path):
            return f'volume "{volume}" is the host path {path}, {_NO_BACKSTEPS}'
    return None


# What a denial says to the operator whose own node software (a GPU Operator component, a
# monitoring agent) it met: the chart's setting, or the namespace label, that spares it.
NODE_SOFTWARE = ("node software that needs it runs in a namespace isolation leaves out (list it in the "
                 "chart's isolation.excludedNamespaces, or label the namespace "
                 "isolation.kata-sandbox-manager.io/exempt=true)")


def control_point_problem(pod: dict[str, Any], points: tuple[str, ...] = CONTROL_POINTS) -> str | None:
    for volume, path in host_paths(pod):
        point = control_point_of(path, points)
        if point:
            return (f'volume "{volume}" is the host path {path}, which reaches {point}, where the node '
                    f"controls its GPUs (device plugins, DRA drivers, CDI specs, the container runtime, "
                    f"PCI devices in sysfs); {NODE_SOFTWARE}, other pods request a GPU resource")
    return None


def _bad_mounts(c: Container) -> Iterator[dict[str, Any]]:
    for mount in c.mounts():
        if has_backstep(str(mount.get("mountPath", ""))) or has_backstep(str(mount.get("subPath", ""))):
            yield mount


def backstep_mount_problem(pod: dict[str, Any], scope: tuple[str, ...]) -> str | None:
    """A mountPath or subPath with ``..``: every container judged on its own."""
    for c in containers(pod, scope):
        for mount in _bad_mounts(c):
            path = str(mount.get("mountPath", ""))
            where = (f"at {path}" if has_backstep(path) else f"with subPath {mount.get('subPath', '')}")
            return f'{c.where} mounts volume "{mount.get("name", "")}" {where}, {_NO_BACKSTEPS}'
    return None
