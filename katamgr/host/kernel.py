"""The kernel a host root talks to.

Reading sysfs and ``/proc`` is reading files, the same on every root. Changing
the node is asking the kernel: a write to a sysfs control file
(``driver_override``, ``<driver>/unbind``, ``drivers_probe``), whether a module
can be loaded, loading it. Every ``HostRoot`` carries the ``Kernel`` that
answers those (``host.kernel``); ``HostRoot.at(path)`` gives ``LinuxKernel``,
the real one. The simulator (``katamgr.simulator``) installs its emulated
kernel on the roots it makes; nothing here knows about it.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from katamgr.host.errors import HostError

if TYPE_CHECKING:
    from katamgr.host.root import HostRoot


class Kernel(Protocol):
    """What katamgr asks of the node's kernel beyond reading files."""

    def write(self, host: HostRoot, host_path: str, value: str) -> None:
        """Write ``value`` to the sysfs control file ``host_path`` (one write call);
        a refused write is a HostError naming the file."""

    def module_loadable(self, host: HostRoot, module: str) -> bool:
        """Whether ``modprobe module`` could load it (it is not loaded now)."""

    def modprobe(self, host: HostRoot, module: str) -> str | None:
        """Load ``module``: None when modprobe succeeded, else what it said (or its
        exit code). A modprobe that cannot be run, or a kernel that refuses the
        module outright, is a HostError."""


@dataclass(frozen=True)
class LinuxKernel:
    """The real kernel, reached through the host root's files and ``modprobe``."""

    def write(self, host: HostRoot, host_path: str, value: str) -> None:
        try:
            fd = os.open(host.path(host_path), os.O_WRONLY)
        except OSError as exc:
            raise HostError(f"cannot open {host_path} for writing: {exc.strerror}") from exc
        try:
            os.write(fd, value.encode())
        except OSError as exc:
            raise HostError(f"the kernel refused {value.strip()!r} written to {host_path}: {exc.strerror}") from exc
        finally:
            os.close(fd)

    def module_loadable(self, host: HostRoot, module: str) -> bool:
        try:
            release = host.path("/proc/sys/kernel/osrelease").read_text().strip()
        except (OSError, UnicodeDecodeError):
            release = ""
        modules = host.path(f"/lib/modules/{release or os.uname().release}")
        # modules.dep names files (vfio-pci.ko.zst); either spelling of the name.
        files = {f"/{module.replace('_', '-')}.ko", f"/{module.replace('-', '_')}.ko"}
        for index in ("modules.dep", "modules.builtin"):
            try:
                text = (modules / index).read_text()
            except OSError:
                continue
            if any(name in text for name in files):
                return True
        return False

    def modprobe(self, host: HostRoot, module: str) -> str | None:
        # In a pod the host root holds only some of the node's dirs (its
        # /lib/modules among them), so modprobe is pointed at it rather than
        # chrooted into it.
        argv = ["modprobe", module] if host.is_real_root else ["modprobe", "-d", str(host.root), module]
        try:
            result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)  # noqa: S603
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise HostError(f"could not run {' '.join(argv)}: {exc}; load {module} on the node (modprobe {module})") from exc
        if result.returncode == 0:
            return None
        return (result.stderr or result.stdout).strip() or f"exit code {result.returncode}"


LINUX = LinuxKernel()
