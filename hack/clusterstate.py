"""A local cluster's processes and their record (DIR/state.json): what runs, by pid, and
how one is started and stopped. Part of hack/local-cluster (localcluster.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import localnode

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
# The simulated host's own services, run on the machine beside its node: its udev
# (nodesim.udev) and its Fabric Manager's socket (nodesim.fabricmanager.daemon).
HOST_COMPONENTS = ("udev", "fabricmanager")
SERVICE_CIDR = "10.0.0.0/24"
SERVICE_IP = "10.0.0.1"  # the first address of SERVICE_CIDR: the `kubernetes` Service
ISSUER = "https://kubernetes.default.svc.cluster.local"
START_TIMEOUT = 120.0  # a first API server start on a loaded 2-core machine takes ~20 s
# kube-apiserver 1.35 logs its shutdown at once on SIGTERM and then lingers (seen for
# well over 30 s here): a local cluster has nothing to drain, so it is killed after this.
STOP_TIMEOUT = 5.0


class Refused(Exception):
    """Nothing was started or stopped; exit 2 with this message."""


@dataclass
class Process:
    name: str
    argv: list[str]
    log: str
    pid: int = 0
    port: int = 0


@dataclass
class State:
    dir: str
    bin: str
    kube_version: str
    ports: dict[str, int] = field(default_factory=dict)
    processes: dict[str, Process] = field(default_factory=dict)
    node_ip: str = ""  # set when the cluster has a node
    host_root: str = ""  # the node's simulated host root, if any
    made: str = ""  # a dir `up` made outside DIR for the kubelet (removed by `down`)

    @property
    def components(self) -> tuple[str, ...]:
        if not self.node_ip:
            return COMPONENTS
        return COMPONENTS + (HOST_COMPONENTS if self.host_root else ()) + localnode.NODE_COMPONENTS

    @property
    def path(self) -> Path:
        return Path(self.dir) / "state.json"

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, self.path)

    @classmethod
    def load(cls, directory: Path) -> State:
        path = directory / "state.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise Refused(f"{directory} holds no local cluster (no {path.name}); "
                          f"start one with: hack/local-cluster up {directory}") from None
        except (OSError, ValueError) as e:
            raise Refused(f"{path} is unreadable ({e}); stop its processes by hand") from None
        processes = {k: Process(**v) for k, v in raw.pop("processes").items()}
        return cls(**raw, processes=processes)


def alive(proc: Process) -> bool:
    """The recorded pid still runs the recorded binary (a reused pid is not ours)."""
    if proc.pid <= 0:
        return False
    try:
        exe = os.readlink(f"/proc/{proc.pid}/exe")
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[1].split()[0] == "Z":
        return False
    return exe.removesuffix(" (deleted)") == proc.argv[0]


def start(proc: Process, env: dict[str, str] | None = None) -> None:
    log = open(proc.log, "ab")  # noqa: SIM115 - handed to the child, closed below
    try:
        child = subprocess.Popen(proc.argv, stdin=subprocess.DEVNULL, stdout=log, env=env,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()
    proc.pid = child.pid


def stop(proc: Process, timeout: float = STOP_TIMEOUT) -> bool:
    """SIGTERM, then SIGKILL after ``timeout``; False if it was not running."""
    if not alive(proc):
        return False
    os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(proc):
            break
        time.sleep(0.1)
    else:
        os.kill(proc.pid, signal.SIGKILL)
        while alive(proc) and time.monotonic() < deadline + 5:
            time.sleep(0.1)
    _reap(proc.pid)
    return True


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
