"""The simulated node's FM socket (``nodesim.fabricmanager.daemon``): a process that sees FM's
directory read-only, as a pod does through the chart's read-only mount, reaches FM through its
socket alone, as it reaches NVIDIA's (a unix socket's connect needs no write to its file system).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from support.waiting import wait_for

# What a pod's process runs: FM's partitions through the library, activating one if asked.
CLIENT = """
import sys
from gpunode.services.fabricmanager import FabricManager, FabricManagerError
sock, lib, activate = sys.argv[1:4]
try:
    with FabricManager.connect(sock, library=lib) as fm:
        if activate != "-":
            fm.activate(int(activate))
        print("active", [p.partition_id for p in fm.partitions() if p.active])
except FabricManagerError as e:
    print("error", e.name)
"""

needs_mounts = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                  reason="a read-only bind mount needs root and unshare (util-linux)")


@pytest.fixture
def served(short_fm):
    h100_fm = short_fm
    proc = subprocess.Popen([sys.executable, "-m", "nodesim.fabricmanager.daemon", str(h100_fm.root)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    sock = Path(h100_fm.socket)
    try:
        wait_for(lambda: stat.S_ISSOCK(sock.lstat().st_mode), "FM's socket served", 10, every=0.05)
        yield h100_fm
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()


def read_only_client(node, activate: str = "-") -> str:
    """CLIENT in a mount namespace where FM's socket dir is bind-mounted read-only."""
    fm_dir = str(Path(node.socket).parent)
    script = (f"mount --bind -o ro {fm_dir} {fm_dir} && "
              f"exec {sys.executable} -c '{CLIENT}' {node.socket} {node.library} {activate}")
    result = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                            capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@needs_mounts
def test_a_process_seeing_fm_read_only_activates_through_the_socket(served):
    assert read_only_client(served, "3") == "active [3]"
    assert served.active() == [3]  # FM's one state: every process sees it
    assert read_only_client(served, "1") == "error FM_ST_IN_USE"


@needs_mounts
def test_without_the_daemon_a_read_only_view_cannot_reach_fm(short_fm):
    # The plain placeholder beside the state: the library opens the state itself and cannot.
    assert read_only_client(short_fm) == "error FM_ST_CONNECTION_NOT_VALID"


def test_stopped_and_restarted_fm_is_served_again(served):
    sock = Path(served.socket)
    served.stop()
    assert not sock.exists()
    served.restart()  # the placeholder touched back: the daemon listens there again
    wait_for(lambda: stat.S_ISSOCK(sock.lstat().st_mode), "FM's socket served again", 10, every=0.05)
    result = subprocess.run([sys.executable, "-c", CLIENT, served.socket, served.library, "-"],
                            capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.stdout.strip() == "error FM_ST_NOT_CONFIGURED"  # waiting for the active list (§5.10)
