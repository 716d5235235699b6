"""The kernel a host root talks to.

Reading sysfs and ``/proc`` is reading files, the same on every root. Changing
the node is asking the kernel: a write to a sysfs control file
(``driver_override``, ``<driver>/unbind``, ``drivers_probe``), whether a module
can be loaded, loading it. Every ``HostRoot`` carries the ``Kernel`` that
answers those (``host.kernel``); ``HostRoot.at(path)`` gives ``LinuxKernel``,
the real one. The simulated node (``nodesim``) installs its emulated
kernel on the roots it makes; nothing here knows about it.
"""

from __future__ import annotations

import os
import subprocess
import threading
from dataclasses import dataclass
from typing import Protocol

from gpunode.host.ccmodes import GpuAdmin
from gpunode.host.errors import HostError
from gpunode.host.gpuadmin import NVIDIA_GPU_TOOLS
from gpunode.host.paths import RootPaths as HostRoot  # the root carries its kernel, not the reverse


class Kernel(Protocol):
    """What katamgr asks of the node's kernel beyond reading files."""

    def write(self, host: HostRoot, host_path: str, value: str) -> None:
        """Write ``value`` to the sysfs control file ``host_path`` (one write call);
        a refused write is a HostError naming the file, and one the kernel holds
        past a bound is a ``BlockedWrite`` (never a hang)."""

    def module_loadable(self, host: HostRoot, module: str) -> bool:
        """Whether ``modprobe module`` could load it (it is not loaded now)."""

    def modprobe(self, host: HostRoot, module: str) -> str | None:
        """Load ``module``: None when modprobe succeeded, else what it said (or its
        exit code). A modprobe that cannot be run, or a kernel that refuses the
        module outright, is a HostError."""

    def gpu_admin(self) -> GpuAdmin:
        """NVIDIA's gpu-admin-tools for this kernel's GPUs (``gpunode.host.ccmodes``)."""


@dataclass(frozen=True)
class LinuxKernel:
    """The real kernel, reached through the host root's files and ``modprobe``.

    ``write_timeout`` bounds a write the kernel may hold (see ``_MAY_BLOCK``).
    """

    write_timeout: float = 10.0

    def write(self, host: HostRoot, host_path: str, value: str) -> None:
        if not host_path.endswith(_MAY_BLOCK):
            _write_now(host.path(host_path), host_path, value)
            return
        _write_bounded(str(host.path(host_path)), host_path, value, self.write_timeout)

    def module_loadable(self, host: HostRoot, module: str) -> bool:
        modules = host.path(f"/lib/modules/{kernel_release(host)}")
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

    def gpu_admin(self) -> GpuAdmin:
        return NVIDIA_GPU_TOOLS


LINUX = LinuxKernel()


def kernel_release(host: HostRoot) -> str:
    """The running kernel's release: the node's own, read through the root where it can be."""
    try:
        release = host.path("/proc/sys/kernel/osrelease").read_text().strip()
    except (OSError, UnicodeDecodeError):
        release = ""
    return release or os.uname().release

# Writes the kernel may hold until a device is released. Unbinding a device
# whose VFIO group a VM has open waits in vfio_unregister_group_dev() for the
# VM to let go, and once the writer gets a signal that wait can no longer be
# interrupted (Linux 6.1 drivers/vfio/vfio_main.c; the kernel logs "Device is
# currently in use, task ... blocked until device is released"). Probing can
# sit in a device reset for as long. ``driver_override`` takes the device lock,
# which such a pending unbind holds (seen on Debian's 6.1 by tests/kernel).
_MAY_BLOCK = ("/unbind", "/bind", "/drivers_probe", "/remove", "/reset", "/driver_override")

# The write runs in a child process so that a write the kernel holds strands
# only that child, never the agent: a thread stuck in the kernel would keep
# our own process from exiting, and no signal frees it. The child is dd
# (coreutils, on every node and in our image): it starts in a millisecond,
# where a second Python takes tens (a second in an emulated guest), and with
# input shorter than its block size it makes exactly one write() call.
_WRITER = ("dd", "status=none", "conv=notrunc,nocreat")

# Writers still held by the kernel, by the file they write; reaped when they finish.
_pending: dict[str, subprocess.Popen] = {}
_pending_lock = threading.Lock()


class BlockedWrite(HostError):
    """The kernel has not returned from a write (or a read) within the bound; it goes
    on in the background (in ``pid``) and completes once the device is released."""

    def __init__(self, host_path: str, value: str | None, seconds: float, pid: int):
        self.host_path = host_path
        self.pid = pid
        what = f"{value.strip()!r} written to {host_path}" if value is not None else f"reading {host_path}"
        if seconds:
            first = f"the kernel did not finish {what} within {seconds:g}s"
        else:
            first = f"an earlier write to {host_path} is still pending in the kernel, so {what} was not tried"
        super().__init__(
            f"{first} (the device is probably held open by a process, a VM); it stays pending in "
            f"process {pid} and takes effect when the device is released: dmesg shows vfio-pci "
            f"'Relaying device request to user' every 10 s while a VM keeps it"
        )


def _write_now(path: os.PathLike[str], host_path: str, value: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError as exc:
        raise HostError(f"cannot open {host_path} for writing: {exc.strerror}") from exc
    try:
        os.write(fd, value.encode())
    except OSError as exc:
        raise HostError(f"the kernel refused {value.strip()!r} written to {host_path}: {exc.strerror}") from exc
    finally:
        os.close(fd)


def _dd(operand: str, path: str, host_path: str, value: str | None, timeout: float) -> tuple[int, str, str]:
    """Run ``dd`` on ``path`` (``of=`` with ``value`` on stdin, or ``if=``) within
    ``timeout``: (exit code, stdout, stderr), or BlockedWrite when the kernel holds it.
    Nothing is tried on a file whose earlier write is still pending: it would only
    queue behind the first in the kernel, one more process stuck for good."""
    _reap()
    with _pending_lock:
        earlier = _pending.get(path)
    if earlier is not None:
        raise BlockedWrite(host_path, value, 0, earlier.pid)
    argv = [*_WRITER, f"of={path}"] if operand == "of" else ["dd", "status=none", f"if={path}"]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE if value is not None else subprocess.DEVNULL,  # noqa: S603
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    except OSError as exc:
        raise HostError(f"cannot start dd for {host_path}: {exc}") from exc
    try:
        out, err = proc.communicate(value, timeout=timeout)
    except subprocess.TimeoutExpired:
        with _pending_lock:
            _pending[path] = proc
        raise BlockedWrite(host_path, value, timeout, proc.pid) from None
    return proc.returncode, out, err


def _write_bounded(path: str, host_path: str, value: str, timeout: float) -> None:
    code, _out, err = _dd("of", path, host_path, value, timeout)
    if code == 0:
        return
    # dd says "dd: failed to open 'F': <strerror>" or "dd: error writing 'F': <strerror>".
    message = (err or "").strip().splitlines()[-1] if (err or "").strip() else ""
    reason = message.rsplit(": ", 1)[-1] if ": " in message else f"dd exit code {code}"
    if "failed to open" in message:
        raise HostError(f"cannot open {host_path} for writing: {reason}")
    raise HostError(f"the kernel refused {value.strip()!r} written to {host_path}: {reason}")


def pending_writes() -> list[int]:
    """PIDs of writers the kernel still holds (reaping those that finished)."""
    _reap()
    with _pending_lock:
        return [p.pid for p in _pending.values()]


def _reap() -> None:
    with _pending_lock:
        for path in [k for k, p in _pending.items() if p.poll() is not None]:
            del _pending[path]


def read_bounded(path: os.PathLike[str] | str, host_path: str, timeout: float = 10.0) -> str | None:
    """A sysfs attribute that waits for the device lock (``driver_override``), read the
    way writes that may block are written: None when it cannot be read, BlockedWrite
    when the kernel holds it, never a hang."""
    if not os.path.exists(path):
        return None
    code, out, _err = _dd("if", str(path), host_path, None, timeout)
    return out if code == 0 else None
