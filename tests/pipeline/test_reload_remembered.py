"""A containerd reload that could not be done is remembered and tried again by the next apply.

Before: with ``restartMode: signal`` and no process holding containerd's socket, apply edited
the config and warned once; the next apply found the config as wanted and said "nothing to
change", though containerd had never read the edit and ran no Kata runtime.

containerd reads its config at start; SIGHUP to the process that owns its socket is how
``restartMode: signal`` asks for that here (``katamgr.runtime.reload``, whose socket owner is
found by SO_PEERCRED, as in tests/runtime/test_containerd_reload.py). The stand-in below is a
process listening on the socket path that notes each SIGHUP.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from support.kataconfig import kata_manager_yaml, prepare_node

from gpunode.kataclasses import GPU
from katamgr.cli import main
from katamgr.exitcodes import Exit
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

SOCKET = "/run/containerd/containerd.sock"
STAND_IN = """
import signal, socket, sys
path, marker = sys.argv[1], sys.argv[2]
def hup(*_):
    open(marker, "a").write("hup\\n")
signal.signal(signal.SIGHUP, hup)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.bind(path); s.listen(8)
print("ready", flush=True)
while True:
    conn, _ = s.accept(); conn.close()
"""


@pytest.fixture
def node(monkeypatch):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    short = Path(tempfile.mkdtemp(dir="/tmp", prefix="rl"))  # a unix socket path is <= 107 bytes
    host = prepare_node(materialise(find_profile("workstation-a6000"), short / "h"))
    (short / "k.yaml").write_text(kata_manager_yaml((GPU,), restart_mode="signal"))
    yield host
    shutil.rmtree(short, ignore_errors=True)


def apply(node, capsys) -> tuple[int, str, str]:
    code = main(["apply", "--host-root", str(node.root), "--config", str(node.root.parent / "k.yaml")])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_failed_reload_is_retried_by_the_next_apply_until_containerd_reads_the_edit(node, capsys):
    code, out, err = apply(node, capsys)
    assert "edited /etc/containerd/config.toml" in out and "no process holds containerd's socket" in err
    kata = json.loads(node.state_path("kata.json").read_text())
    assert "no process holds" in kata["containerd"]["/etc/containerd/config.toml"]["reloadPending"]

    code, out, err = apply(node, capsys)  # nothing else to change: the reload is still owed
    assert code == Exit.PROBLEMS, err
    assert "nothing to change" not in out
    assert "containerd has still not read katamgr's edit of /etc/containerd/config.toml" in err

    path = node.path(SOCKET)
    path.parent.mkdir(parents=True, exist_ok=True)
    marker = node.root.parent / "hups"
    stand_in = subprocess.Popen([sys.executable, "-c", STAND_IN, str(path), str(marker)],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert stand_in.stdout.readline().strip() == "ready"
        code, out, err = apply(node, capsys)
        assert code == Exit.OK, err
        assert f"sent SIGHUP to containerd (pid {stand_in.pid}) (containerd had not read katamgr's earlier " \
               "edit of /etc/containerd/config.toml: no process holds" in out
        deadline = time.monotonic() + 5
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marker.read_text() == "hup\n"
        kata = json.loads(node.state_path("kata.json").read_text())
        assert "reloadPending" not in kata["containerd"]["/etc/containerd/config.toml"]
        code, out, _ = apply(node, capsys)
        assert (code, out.strip()) == (Exit.OK, "nothing to change: the node is already as planned")
    finally:
        stand_in.kill()
        stand_in.wait()
