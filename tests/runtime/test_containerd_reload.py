"""Reloading containerd: SIGHUP to the real owner of a real unix socket, systemctl argv."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gpunode.errors import ConfigError, GpuNodeError
from gpunode.host.root import HostRoot
from katamgr.runtime.reload import (
    CommandResult,
    RestartMode,
    reload_containerd,
    socket_owner,
)

# A stand-in daemon: listens on a unix socket like containerd and records SIGHUP.
DAEMON = """
import signal, socket, sys, time
sock_path, marker = sys.argv[1], sys.argv[2]
def hup(signum, frame):
    open(marker, "w").write("hup")
    sys.exit(0)
signal.signal(signal.SIGHUP, hup)
s = socket.socket(socket.AF_UNIX)
s.bind(sock_path)
s.listen()
print("ready", flush=True)
time.sleep(30)
"""


@pytest.fixture
def daemon(tmp_path: Path):
    sock = tmp_path / "containerd.sock"
    marker = tmp_path / "hup"
    proc = subprocess.Popen(  # noqa: S603 - fixed argument list
        [sys.executable, "-c", DAEMON, str(sock), str(marker)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    yield proc, sock, marker
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_signal_mode_finds_the_socket_owner_and_sends_sighup(daemon) -> None:
    proc, sock, marker = daemon
    host = HostRoot.at("/")
    assert socket_owner(host, str(sock)) == proc.pid

    result = reload_containerd(host, "signal", socket_path=str(sock))

    assert result.done and f"pid {proc.pid}" in result.message
    proc.wait(timeout=10)
    deadline = time.monotonic() + 5
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert marker.read_text() == "hup"


def test_the_socket_names_its_owner_without_any_proc_table() -> None:
    # A listener in this very process, under a host root that has no /proc at all: only
    # the socket's peer credentials (SO_PEERCRED) can name the PID, as in a pod without
    # the host network namespace, whose /proc/net/unix does not list containerd's socket.
    with tempfile.TemporaryDirectory(dir="/tmp") as root:  # short: a unix path is <= 107 bytes
        host = HostRoot.at(root)
        path = host.path("/run/containerd/containerd.sock")
        path.parent.mkdir(parents=True)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(str(path))
            listener.listen()
            assert not host.path("/proc").exists()
            assert socket_owner(host, "/run/containerd/containerd.sock") == os.getpid()
            sent: list[tuple[int, int]] = []
            result = reload_containerd(host, "signal", send_signal=lambda pid, sig: sent.append((pid, sig)))
        assert result.done and sent == [(os.getpid(), signal.SIGHUP)]
        # Nobody listening any more: no PID, and nothing is signalled.
        assert socket_owner(host, "/run/containerd/containerd.sock") is None


def test_signal_mode_without_an_owner_warns_and_does_nothing(tmp_path: Path) -> None:
    sent: list[tuple[int, int]] = []
    result = reload_containerd(
        HostRoot.at("/"),
        RestartMode.SIGNAL,
        socket_path=str(tmp_path / "nobody.sock"),
        send_signal=lambda pid, sig: sent.append((pid, sig)),
    )
    assert not result.done and "no process holds" in result.message
    assert sent == []


def test_systemd_mode_runs_systemctl_in_the_host_root(tmp_path: Path) -> None:
    calls: list[list[str]] = []

    def runner(argv):
        calls.append(list(argv))
        return CommandResult(0, "")

    host = HostRoot.at(tmp_path)
    assert reload_containerd(host, "systemd", runner=runner).done
    assert reload_containerd(HostRoot.at("/"), "systemd", runner=runner).done
    assert calls == [
        ["chroot", str(host.root), "systemctl", "restart", "containerd"],
        ["systemctl", "restart", "containerd"],
    ]


def test_systemd_failure_is_reported_with_the_command(tmp_path: Path) -> None:
    with pytest.raises(GpuNodeError, match="systemctl restart containerd' failed with exit code 5"):
        reload_containerd(
            HostRoot.at(tmp_path),
            "systemd",
            runner=lambda argv: CommandResult(5, "Unit containerd.service not found."),
        )


def test_none_mode_only_tells_the_operator() -> None:
    result = reload_containerd(HostRoot.at("/"), "none", runner=lambda argv: pytest.fail("ran"))
    assert not result.done and "restart containerd" in result.message


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="restartMode 'reboot'"):
        reload_containerd(HostRoot.at("/"), "reboot")
