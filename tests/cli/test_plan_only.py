"""`katamgr run --plan-only` (the chart's kataManager.planOnly): the agent works the plan out
and publishes it, and the node is byte for byte as it was, every file, link and mode
under the host root; it also runs on a host root mounted read-only, as the chart mounts
it in that mode."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from support.hostkit import GPU_A10, dev, make_host
from support.kataconfig import kata_manager_yaml, prepare_node
from support.paths import REQUIRE_INTEGRATION
from support.waiting import wait_for

KATAMGR = str(Path(sys.executable).parent / "katamgr")


def node(tmp_path: Path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4), dev("0000:02:00.0", GPU_A10, "nvidia", 5)])
    prepare_node(host)
    config = tmp_path / "kata-manager.yaml"
    config.write_text(kata_manager_yaml())
    return host, config


def tree(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: its type, mode, mtime and content (or link target)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                what = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                what = path.read_bytes()
            else:
                what = None
            out[str(path.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_mode, st.st_mtime_ns, what)
    return out


def test_run_plan_only_once_logs_the_plan_and_changes_nothing(tmp_path):
    host, config = node(tmp_path)
    before = tree(host.root)
    result = subprocess.run([KATAMGR, "run", "--plan-only", "--once", "--host-root", str(host.root),
                             "--config", str(config)], capture_output=True, text=True, timeout=120)
    # The simulated A10 server has no problem to report: 0 (the exit code table's "as planned").
    assert result.returncode == 0, result.stderr
    assert "nothing is carried out" in result.stderr
    assert "0000:01:00.0" in result.stderr and "bind" in result.stderr  # what apply would do
    assert "kata-qemu-nvidia-gpu" in result.stderr  # the Kata chain's part of the plan too
    assert tree(host.root) == before


def test_run_plan_only_serves_the_plan_and_stops_with_nothing_changed(tmp_path):
    host, config = node(tmp_path)
    before = tree(host.root)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([KATAMGR, "run", "--plan-only", "--host-root", str(host.root), "--config", str(config),
                             "--metrics-address", f"127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def get(path: str) -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:  # noqa: S310
                return answer.read().decode()
        except OSError:
            return None

    try:
        ready = wait_for(lambda: get("/readyz"), "/readyz ready", timeout=60)
        assert "plan only (nothing is changed): apply would bind 2 device(s)" in ready
        metrics = get("/metrics")
        assert 'katamgr_devices{action="bind",driver="nvidia",kind="gpu"} 2.0' in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "received SIGTERM" in err
    assert tree(host.root) == before


def test_run_plan_only_on_a_read_only_host_root(tmp_path):
    """The chart mounts the host read-only in plan-only mode: a write would fail with EROFS,
    so a plan that succeeds here attempted none."""
    if os.geteuid() != 0:
        message = "a read-only bind mount needs root"
        if REQUIRE_INTEGRATION:
            pytest.fail(message)
        pytest.skip(message)
    host, config = node(tmp_path)
    script = 'mount --bind -o ro "$1" "$1" && exec "$2" run --plan-only --once --host-root "$1" --config "$3"'
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                             str(host.root), KATAMGR, str(config)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "nothing is carried out" in result.stderr and "0000:02:00.0" in result.stderr


def test_run_plan_only_without_any_capability(tmp_path):
    """The chart runs the plan-only agent unprivileged: root (the host's root-owned files),
    every capability dropped, no_new_privs (allowPrivilegeEscalation: false), the host
    read-only. The plan is still worked out in full."""
    if os.geteuid() != 0:
        message = "a read-only bind mount and dropping capabilities need root"
        if REQUIRE_INTEGRATION:
            pytest.fail(message)
        pytest.skip(message)
    host, config = node(tmp_path)
    before = tree(host.root)
    script = ('mount --bind -o ro "$1" "$1" && exec setpriv --bounding-set=-all --inh-caps=-all '
              '--ambient-caps=-all --no-new-privs "$2" run --plan-only --once --host-root "$1" --config "$3"')
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                             str(host.root), KATAMGR, str(config)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "nothing is carried out" in result.stderr and "0000:01:00.0" in result.stderr
    assert tree(host.root) == before


@pytest.mark.parametrize("flag", ["--revert-on-exit", "--cc-manager"])
def test_plan_only_refuses_a_flag_that_would_change_the_node(tmp_path, flag):
    host, _ = node(tmp_path)
    result = subprocess.run([KATAMGR, "run", "--plan-only", flag, "--host-root", str(host.root)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"--plan-only changes nothing, so it cannot be given with {flag}" in result.stderr
