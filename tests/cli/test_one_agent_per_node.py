"""One agent per node: a second ``katamgr run`` (another config) waits ``--wait`` seconds for
the first and then fails naming it, and ``apply`` beside a running agent refuses, both having
changed nothing.

Before: two ``katamgr run`` with different configs on one node rewrote containerd's config
113-325 times in seconds, with no warning: each held the node lock only for one reconcile,
and the other's edit looked like someone else dropping its runtimes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.kataconfig import kata_manager_yaml, prepare_node

from gpunode.kataclasses import GPU
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

KATAMGR = str(Path(sys.executable).parent / "katamgr")
CONTAINERD = "/etc/containerd/config.toml"


@pytest.fixture
def node(tmp_path):
    host = prepare_node(materialise(find_profile("workstation-a6000"), tmp_path / "host"))
    for name, directory in (("a.yaml", "/opt/artifacts-a"), ("b.yaml", "/opt/artifacts-b")):
        (tmp_path / name).write_text(kata_manager_yaml((GPU,), artifacts_dir=directory))
    return host


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}


def test_a_second_agent_or_an_apply_beside_the_first_is_refused_naming_it(node, tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first = subprocess.Popen([KATAMGR, "run", "--host-root", str(node.root), "--config", str(a)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    try:
        deadline = time.monotonic() + 60
        while "/opt/artifacts-a" not in node.path(CONTAINERD).read_text():
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.1)
        written = node.path(CONTAINERD).read_bytes()

        started = time.monotonic()
        second = subprocess.run([KATAMGR, "run", "--host-root", str(node.root), "--config", str(b),
                                 "--wait", "1"], capture_output=True, text=True, timeout=60, env=env())
        assert second.returncode == 1, second.stderr
        assert time.monotonic() - started < 30
        assert f"another katamgr agent runs on this node (pid {first.pid} (katamgr run, config {a})" \
            in second.stderr
        assert "waited 1 s (--wait), nothing was changed" in second.stderr

        applied = subprocess.run([KATAMGR, "apply", "--host-root", str(node.root), "--config", str(b)],
                                 capture_output=True, text=True, timeout=60, env=env())
        assert applied.returncode == 1, applied.stderr
        assert f"a katamgr agent runs on this node (pid {first.pid} (katamgr run, config {a}))" in applied.stderr
        assert "nothing was changed" in applied.stderr
        # The first agent's config stands, written once, and the second left no artifacts.
        assert node.path(CONTAINERD).read_bytes() == written
        assert not node.path("/opt/artifacts-b").exists()
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)
    assert first.returncode == 0
    # The agent gone, the next one starts at once.
    again = subprocess.run([KATAMGR, "run", "--once", "--host-root", str(node.root), "--config", str(b),
                            "--wait", "1"], capture_output=True, text=True, timeout=120, env=env())
    assert again.returncode == 0, again.stderr
    assert "/opt/artifacts-b" in node.path(CONTAINERD).read_text()
