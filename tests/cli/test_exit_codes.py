"""The one table of exit codes, as --help and docs/operating.md show it, and the codes the
commands end with where a script must tell the cases apart."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from support.paths import REPO

from katamgr.exitcodes import MEANING, Exit

KATAMGR = str(Path(sys.executable).parent / "katamgr")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([KATAMGR, *args], capture_output=True, text=True, timeout=120)


def test_operating_md_prints_the_table_of_exitcodes():
    text = (REPO / "docs" / "operating.md").read_text()
    block = text.split("<!-- exit-codes:", 1)[1].split("<!-- /exit-codes -->", 1)[0]
    rows = dict(re.findall(r"^\| (\d+) \| (.+) \|$", block, re.M))
    assert rows == {str(int(code)): meaning for code, meaning in MEANING.items()}


def test_help_lists_every_code_and_promises_nothing_else():
    text = " ".join(run("--help").stdout.split())
    for code, meaning in MEANING.items():
        assert f"{int(code)} {' '.join(meaning.split())}" in text
    assert "left as it was or rolled back" not in text


def test_the_demo_on_a_host_without_an_iommu_says_why_it_cannot_pass_a_gpu_through():
    result = run("demo", "--profile", "no-iommu-t4")
    assert result.returncode == Exit.PROBLEMS, result.stderr[-2000:]
    assert "katamgr demo: no GPU of the simulated node could be offered to a pod: The IOMMU is off" \
        in result.stderr


def _hold(host, pid: int, comm: str, node: str) -> None:
    """A process with ``node`` open, as /proc shows it (an fd linking to the node)."""
    fd_dir = host.path(f"/proc/{pid}/fd")
    fd_dir.mkdir(parents=True)
    (fd_dir.parent / "comm").write_text(comm + "\n")
    (fd_dir / "12").symlink_to(node)


def test_a_held_gpu_is_a_problem_for_plan_and_apply_and_force_names_who_loses_it(tmp_path):
    from support.hostkit import GPU_A10, dev, driver_of, make_host

    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4, minor=0),
                                dev("0000:02:00.0", GPU_A10, "nvidia", 5, minor=1)])
    _hold(host, 4242, "python3", "/dev/nvidia0")  # a CUDA process on the first GPU
    root = ["--host-root", str(host.root)]
    plan = run("plan", *root)
    assert plan.returncode == Exit.PROBLEMS, plan.stderr
    assert "0000:01:00.0: in use by PID 4242 (python3) holding /dev/nvidia0" in plan.stdout
    first = run("apply", *root)
    assert first.returncode == Exit.PROBLEMS, first.stderr
    assert "changed: bound 0000:02:00.0" in first.stdout
    again = run("apply", *root)
    # Nothing changed, but a GPU was left out: said, and never "already as planned".
    assert again.returncode == Exit.PROBLEMS, again.stderr
    assert "warning: 0000:01:00.0: in use by PID 4242 (python3)" in again.stderr  # warnings: stderr
    assert "nothing to change" not in again.stdout + again.stderr
    forced = run("apply", *root, "--force")
    assert forced.returncode == Exit.FORCED, forced.stderr
    assert "--force: 0000:01:00.0 is taken from PID 4242 (python3) holding /dev/nvidia0" in forced.stderr
    assert driver_of(host, "0000:01:00.0") == "vfio-pci"
