"""kill -9 at a write point of apply or revert, then either command: the node converges.

``support.crashsweep`` kills ``katamgr apply``/``revert`` (forked, with a real SIGKILL
at the N-th write point, see ``gpunode.host.faults``) on a simulated node with GPUs,
two Kata runtime classes and a containerd config, then runs ``apply`` or ``revert``
to the end and compares the node, file by file, with what an uninterrupted run
leaves: no temp file, staging dir, lock file or half-removed install may remain.
This runs a spread of points; ``bench/reliability.py`` (its crash points) runs all of them. The same points
fail with EROFS and ENOSPC instead (``KATAMGR_FAIL_AT``): said, never a crash, and undone
by a revert.
"""

from __future__ import annotations

import pytest
from support import crashsweep

SAMPLE = 8


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_a_kill_at_any_sampled_write_point_converges(command):
    with crashsweep.workspace() as base:
        total = len(crashsweep.write_points(base, command))
    assert total >= 10, f"{command} has only {total} write points: are they still marked?"
    points = crashsweep.spread(total, SAMPLE)
    result = crashsweep.sweep(command, points)
    assert result.failures == []
    assert result.figure("apply") == result.figure("revert") == f"{len(points)}/{len(points)}"


@pytest.mark.parametrize("error", ["EROFS", "ENOSPC"])
@pytest.mark.parametrize("command", ["apply", "revert"])
def test_a_write_that_fails_at_any_sampled_point_is_said_and_undone(command, error):
    """A directory made read-only, or a disk that fills, after the checks: the run says what
    failed and what it kept (and the revert that undoes it), and that revert converges."""
    with crashsweep.workspace() as base:
        total = len(crashsweep.write_points(base, command))
    points = crashsweep.spread(total, SAMPLE)
    result = crashsweep.fault_sweep(command, error, points)
    assert result.failures == []
    assert result.figure("revert") == f"{len(points)}/{len(points)}"


def test_the_sweep_notices_litter():
    """The comparison is strict enough to catch what a killed run used to leave."""
    with crashsweep.workspace() as base:
        root = crashsweep.new_node(base / "node")
        assert crashsweep.run(root, "apply") == 0
        clean = crashsweep.snapshot(root)
        (root / "etc/containerd/.config.toml.abcd1234.tmp").write_text("half")
        staging = root / "opt/nvidia-gpu-operator/artifacts/runtimeclasses/.kata-qemu-nvidia-gpu.staging-x"
        staging.mkdir()
        problem = crashsweep.diff(crashsweep.snapshot(root), clean)
    assert ".config.toml.abcd1234.tmp" in problem and ".staging-x" in problem
