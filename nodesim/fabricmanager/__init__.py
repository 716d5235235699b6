"""NVIDIA Fabric Manager on the simulated node: FM's SDK library (a stand-in ``libnvfm.so.1``
built from ``libnvfm.c`` with the machine's C compiler) and the FM "daemon" it talks to.

FM keeps its partitions in its daemon; every process that connects (the device plugin,
katamgr, a test) sees and changes the same ones. The stand-in keeps them in a state file
beside FM's unix socket (``<socket>.state``), read and written under ``flock`` by every call.
The socket path existing is FM running; ``stop`` removes it, ``restart`` brings FM back as
``nv-fabricmanager --restart`` does (guide, "Resiliency"): it no longer knows which
partitions are active and refuses partition calls until it is told
(``fmSetActivatedFabricPartitions``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = (HERE / "libnvfm.c", HERE / "nvfm_sdk.h")
PLATFORMS = ("hgx-h100", "hgx-a100")
MODES = ("shared", "baremetal")
# Where the simulated node's FM listens and its SDK library lies (host paths); FM's own
# default is TCP 127.0.0.1:6666, a unix socket is its FM_CMD_UNIX_SOCKET_PATH setting.
SOCKET = "/run/nvidia-fabricmanager/fm.sock"
LIBRARY = "/usr/lib/nvidia-fabricmanager/libnvfm.so.1"


class FabricManagerStandInError(RuntimeError):
    """The stand-in library could not be built (no C compiler)."""


@dataclass(frozen=True)
class FabricManagerSpec:
    """A profile's ``fabric_manager``: FM's mode (``FABRIC_MODE=1`` is ``shared``), the
    baseboard whose partition table it serves, and each GPU's physical (module) ID."""

    platform: str = "hgx-h100"
    mode: str = "shared"
    gpus: Mapping[int, str] = field(default_factory=dict)  # module ID -> BDF
    socket: str = SOCKET


def build_library() -> Path:
    """The stand-in library, compiled once per version of its sources into the user's cache
    (``$XDG_CACHE_HOME/kata-sandbox-manager/nvfm/<hash>/``)."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    dest = cache / "kata-sandbox-manager" / "nvfm" / digest / "libnvfm.so.1"
    if dest.is_file():
        return dest
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise FabricManagerStandInError("the Fabric Manager stand-in needs a C compiler (gcc); .ci/setup installs it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    try:
        subprocess.run([cc, "-O2", "-Wall", "-shared", "-fPIC", f"-Wl,-soname,{dest.name}", "-o", str(tmp),
                        str(HERE / "libnvfm.c")], check=True, capture_output=True, timeout=120)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        detail = getattr(e, "stderr", b"") or b""
        raise FabricManagerStandInError(f"the Fabric Manager stand-in did not compile with {cc}: "
                                        f"{detail.decode(errors='replace').strip()[:300]}") from None
    os.replace(tmp, dest)
    return dest


def start(root: Path | str, spec: FabricManagerSpec) -> Path:
    """FM started on the node under ``root``: its library in place, its socket and a fresh
    state (no partition active). Returns the library's path on this machine."""
    root = Path(root)
    library = root / LIBRARY.lstrip("/")
    library.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(build_library(), library)
    sock = root / spec.socket.lstrip("/")
    sock.parent.mkdir(parents=True, exist_ok=True)
    gpus = "".join(f"gpu {n} {_nvml_bus_id(bdf)} -\n" for n, bdf in sorted(spec.gpus.items()))
    state_of(sock).write_text(f"mode {spec.mode}\nplatform {spec.platform}\nrestarting 0\ndelay_ms 0\n{gpus}active\n")
    sock.touch()
    return library


def stop(root: Path | str, socket: str = SOCKET) -> None:
    """FM stopped: its socket gone (the state stays: FM's resiliency keeps the fabric)."""
    (Path(root) / socket.lstrip("/")).unlink(missing_ok=True)


def restart(root: Path | str, socket: str = SOCKET) -> None:
    """FM started again with ``--restart``: waiting for the list of active partitions."""
    sock = Path(root) / socket.lstrip("/")
    _edit(state_of(sock), lambda lines: [("restarting 1" if ln.startswith("restarting") else
                                          "active" if ln.startswith("active") else ln) for ln in lines])
    sock.touch()


def set_delay(root: Path | str, delay_ms: int, socket: str = SOCKET) -> None:
    """Every FM call takes ``delay_ms``: an FM that answers late (or not at all)."""
    sock = Path(root) / socket.lstrip("/")
    _edit(state_of(sock), lambda lines: [(f"delay_ms {delay_ms}" if ln.startswith("delay_ms") else ln)
                                         for ln in lines])


def active(root: Path | str, socket: str = SOCKET) -> list[int]:
    """The partitions FM has active, read as FM's own state."""
    for line in state_of(Path(root) / socket.lstrip("/")).read_text().splitlines():
        if line.startswith("active"):
            return sorted(int(x) for x in line.split()[1:])
    return []


def state_of(sock: Path) -> Path:
    return sock.with_name(sock.name + ".state")


def _edit(path: Path, change) -> None:
    with open(path, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        lines = change(f.read().splitlines())
        f.seek(0)
        f.truncate()
        f.write("\n".join(lines) + "\n")


def _nvml_bus_id(bdf: str) -> str:
    """A PCI address as NVML and FM print it: an 8-digit domain, capitals
    (``00000000:1B:00.0``)."""
    domain, rest = bdf.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}"
