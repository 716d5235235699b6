"""The host root: every host path goes through it.

In a DaemonSet the node's filesystem is mounted at /host; in tests it is a temp
dir. Code *reads and writes* through ``HostRoot.path(...)``, but what it writes
*into* host files (a config path, a device node) is the host-side path, never
prefixed with the root we happen to see it through.

A root also carries the kernel that answers its control writes and module loads
(``gpunode.host.kernel``): the real one unless whoever made the root says
otherwise (the simulated node, ``nodesim``, gives its roots an emulated one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from gpunode.host.kernel import LINUX, Kernel

# Where katamgr keeps what it needs to undo its own changes.
STATE_DIR = "/var/lib/kata-sandbox-manager"
# The kubelet's root directory (its --root-dir) unless the node's kubelet has another (k0s:
# /var/lib/k0s/kubelet; microk8s: /var/snap/microk8s/common/var/lib/kubelet). Its
# pod-resources, plugins and plugins_registry dirs are below it (kubelet_getters.go
# getPodResourcesDir, getPluginsDir, getPluginsRegistrationDir); the device plugins' dir is
# not (kubeletapi.deviceplugin_paths).
KUBELET_DIR = "/var/lib/kubelet"


@dataclass(frozen=True)
class HostRoot:
    root: Path = Path("/")
    kernel: Kernel = LINUX
    # Where the node's / is as the container runtime sees it: "/" on a real node; the
    # chart's hostPaths.rootFS when the node's files live below another dir (the local
    # node of hack/local-cluster runs on a simulated root).
    runtime_root: str = "/"
    # The kubelet's root directory on this host (--kubelet-dir; the chart's
    # hostPaths.kubeletRootDir).
    kubelet_dir: str = KUBELET_DIR

    @classmethod
    def at(cls, root: str | Path, kernel: Kernel = LINUX, runtime_root: str = "/",
           kubelet_dir: str = KUBELET_DIR) -> HostRoot:
        return cls(Path(root).resolve(), kernel, runtime_root, kubelet_dir)

    def path(self, host_path: str | PurePosixPath) -> Path:
        """Map a host path ("/sys/bus/pci") to where we can reach it."""
        rel = str(host_path).lstrip("/")
        return self.root / rel if rel else self.root

    def host_path(self, local: Path) -> str:
        """Map a reachable path back to the path as the host sees it."""
        rel = Path(local).relative_to(self.root)
        return "/" + str(rel) if str(rel) != "." else "/"

    @property
    def is_real_root(self) -> bool:
        return self.root == Path("/")

    def runtime_node(self, host_path: str) -> str:
        """The path the container runtime opens for the device node ``host_path``
        (what CDI's ``hostPath`` and the kubelet's DeviceSpec name)."""
        at = self.runtime_root.rstrip("/")
        return at + host_path if at else host_path

    def host_node(self, runtime_path: str) -> str:
        """``runtime_node`` undone: the device node as this root's host sees it."""
        at = self.runtime_root.rstrip("/")
        if at and runtime_path.startswith(at + "/"):
            return runtime_path[len(at):]
        return runtime_path

    def state_path(self, name: str) -> Path:
        return self.path(f"{STATE_DIR}/{name}")

    def __str__(self) -> str:
        return str(self.root)
