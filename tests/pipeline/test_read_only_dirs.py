"""A host directory katamgr must write that is read-only: found before the first write.

Run as an operator would (the real ``katamgr`` in a process) on a simulated node. The
directory is made immutable with ``chattr +i``, which refuses every write to it, root's
included, as a read-only mount does (EPERM there, EROFS on a mount: both fail access(W_OK)).
apply then exits 1 with one sentence naming the directory and changes nothing; revert on such
a directory does what it can, names what it could not undo and why, and exits 1.
"""

from __future__ import annotations

import subprocess

import pytest
from support.hostkit import driver_of
from test_node_safety import GPUS, but_the_lock, config, katamgr, node, whole

DIRS = ["/var/run/cdi", "/run/nvidia/validations", "/opt/nvidia-gpu-operator/artifacts/runtimeclasses"]


def immutable(path, on: bool) -> None:
    subprocess.run(["chattr", "+i" if on else "-i", str(path)], check=True)


@pytest.mark.parametrize("directory", DIRS)
def test_a_read_only_directory_stops_apply_before_the_first_write(tmp_path, directory):
    host = node(tmp_path)
    cfg = config(tmp_path)
    host.path(directory).mkdir(parents=True)
    before = whole(host)
    immutable(host.path(directory), True)
    try:
        result = katamgr("apply", "--host-root", str(host.root), "--config", cfg)
    finally:
        immutable(host.path(directory), False)
    assert result.returncode == 1, result.stderr
    assert f"{directory} cannot be written (read-only, immutable or not ours)" in result.stderr
    assert "nothing was changed" in result.stderr and "unexpected" not in result.stderr
    assert [driver_of(host, b) for b in GPUS] == ["nvidia"] * 3
    assert but_the_lock(whole(host), before) == before


def test_a_read_only_state_dir_is_said_before_anything(tmp_path):
    host = node(tmp_path)
    state = host.path("/var/lib/kata-sandbox-manager")
    state.mkdir(parents=True)
    immutable(state, True)
    try:
        result = katamgr("apply", "--host-root", str(host.root))
    finally:
        immutable(state, False)
    assert result.returncode == 1, result.stderr
    assert "cannot take the node lock /var/lib/kata-sandbox-manager/node.lock" in result.stderr
    assert "nothing was changed" in result.stderr
    assert [driver_of(host, b) for b in GPUS] == ["nvidia"] * 3


def test_revert_on_a_read_only_directory_does_what_it_can_and_says_what_it_left(tmp_path):
    host = node(tmp_path)
    cfg = config(tmp_path)
    assert katamgr("apply", "--host-root", str(host.root), "--config", cfg).returncode == 0
    immutable(host.path("/var/run/cdi"), True)
    try:
        result = katamgr("revert", "--host-root", str(host.root), "--config", cfg)
    finally:
        immutable(host.path("/var/run/cdi"), False)
    assert result.returncode == 1, result.stderr
    assert "unexpected" not in result.stderr
    # The specs could not go, and it says so; the GPUs and containerd's config went back all the same.
    assert "removing the CDI specs stopped: a write failed" in result.stderr and "left as it is" in result.stderr
    assert [driver_of(host, b) for b in GPUS] == ["nvidia"] * 3
    assert "restored /etc/containerd/config.toml" in result.stdout
    again = katamgr("revert", "--host-root", str(host.root), "--config", cfg)
    assert again.returncode == 0, again.stderr
    assert not host.path("/var/run/cdi/nvidia.com-GA102GL_A10.yaml").exists()
