"""What code below ``HostRoot`` needs of a root: its prefix and its path mapping.

``gpunode.host.root.HostRoot`` carries its kernel, and the kernel (with NVIDIA's tool it
hands out) works on a root, so the kernel side names the root by this Protocol rather than
by the class: the imports then run one way, root -> kernel -> paths.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Protocol


class RootPaths(Protocol):
    """A host root as the kernel and NVIDIA's tool use it (``HostRoot`` is one)."""

    root: Path

    @property
    def is_real_root(self) -> bool: ...

    def path(self, host_path: str | PurePosixPath) -> Path: ...
