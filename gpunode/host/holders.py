"""Which processes hold a GPU's /dev/nvidia<minor> open.

Unbinding a GPU from ``nvidia`` under a running CUDA process takes that
workload down, so binding asks this first and names the PIDs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from gpunode.host.root import HostRoot

_UUID = re.compile(r"^GPU UUID:\s*(GPU-[0-9a-fA-F-]+)\s*$", re.MULTILINE)
_MINOR = re.compile(r"^Device Minor:\s*(\d+)", re.MULTILINE)


@dataclass(frozen=True)
class Holder:
    pid: int
    comm: str
    path: str

    def __str__(self) -> str:
        return f"PID {self.pid} ({self.comm}) holding {self.path}"


def gpu_minor(host: HostRoot, bdf: str) -> int | None:
    """The nvidia driver's minor number for the GPU, from /proc/driver/nvidia."""
    try:
        text = host.path(f"/proc/driver/nvidia/gpus/{bdf}/information").read_text()
    except OSError:
        return None
    match = _MINOR.search(text)
    return int(match.group(1)) if match else None


def gpu_uuid(host: HostRoot, bdf: str) -> str | None:
    """The GPU's UUID as the nvidia driver shows it (``GPU UUID:`` in /proc/driver/nvidia/gpus/
    <bdf>/information; the ID NVIDIA's device plugin advertises it by); None when not there."""
    try:
        text = host.path(f"/proc/driver/nvidia/gpus/{bdf}/information").read_text()
    except OSError:
        return None
    match = _UUID.search(text)
    return match.group(1) if match else None


def holders(host: HostRoot, paths: set[str]) -> list[Holder]:
    """Processes with any of ``paths`` (host paths) open, found via /proc/*/fd."""
    if not paths:
        return []
    found: list[Holder] = []
    proc = host.path("/proc")
    try:
        pids = [name for name in os.listdir(proc) if name.isdigit()]
    except OSError:
        return []
    for pid in pids:
        fd_dir = proc / pid / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue  # gone, or not ours to read
        for fd in fds:
            try:
                target = os.readlink(fd_dir / fd)
            except OSError:
                continue
            if target in paths:
                try:
                    comm = (proc / pid / "comm").read_text().strip()
                except OSError:
                    comm = "?"
                found.append(Holder(int(pid), comm, target))
    return sorted(found, key=lambda h: (h.pid, h.path))
