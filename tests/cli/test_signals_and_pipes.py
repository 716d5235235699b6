"""SIGINT and SIGTERM stop ``apply`` at the next safe point, list what was done and name the
revert, with the exit codes of the one table; a reader that goes away (``| head -1``) never
stops the work half-way nor changes its exit code.

Before: SIGINT waited for the blob under way (21 s) and listed nothing; SIGTERM exited 143,
outside the table, saying nothing; ``apply 2>&1 | head -1`` stopped after 1 of 8 groups;
``revert | head`` reverted, then exited 1 with "unexpected BrokenPipeError".

The signals are real ones sent to a real ``katamgr`` process (as the kubelet sends SIGTERM,
a terminal SIGINT); Python ignores SIGPIPE, so a closed pipe is a BrokenPipeError on the
next write (the Python docs' "Note on SIGPIPE"). The moment a step is under way is held
open by ``KATAMGR_PAUSE_AT`` (``gpunode.host.faults``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.kataconfig import kata_manager_yaml, prepare_node

from gpunode.host import faults
from katamgr.exitcodes import MEANING, Exit
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "artifacts"))
from trickle import TrickleRegistry  # noqa: E402 - the artifact tests' trickling registry

KATAMGR = str(Path(sys.executable).parent / "katamgr")
DGX_GPUS = 8
# Within 2 s on an idle machine; the bound leaves a loaded CI machine its slack and stays far
# below what waiting would take (a trickled blob: 60 s before the registry gives up).
STOP_BOUND = 5.0


def _env(**extra: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items()
               if k not in (faults.CRASH_AT, faults.WRITE_LOG, faults.PAUSE_AT, faults.FAIL_AT, "KUBECONFIG")}
    return environ | {"COLUMNS": "300"} | extra


def _bound(root: Path) -> list[str]:
    out = subprocess.run([KATAMGR, "status", "--host-root", str(root), "-o", "json"], capture_output=True,
                         text=True, timeout=60, env=_env())
    return [d["bdf"] for d in json.loads(out.stdout)["devices"]]


def _wait_for(predicate, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_table_holds_both_stop_signals():
    assert (Exit.INTERRUPTED, Exit.TERMINATED) == (128 + signal.SIGINT, 128 + signal.SIGTERM)
    assert "SIGINT" in MEANING[Exit.INTERRUPTED] and "SIGTERM" in MEANING[Exit.TERMINATED]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_a_bind_finishes_that_group_then_stops_and_lists_what_was_done(tmp_path, signum):
    # Where the third GPU's group starts, counted on a twin of the node.
    twin = materialise(find_profile("dgx-h100"), tmp_path / "twin")
    points = tmp_path / "points"
    assert subprocess.run([KATAMGR, "apply", "--host-root", str(twin.root)], capture_output=True,
                          timeout=120, env=_env(**{faults.WRITE_LOG: str(points)})).returncode == 0
    third = next(int(line.split()[0]) for line in points.read_text().splitlines() if "0000:13:00.0" in line)

    host = materialise(find_profile("dgx-h100"), tmp_path / "node")
    log = tmp_path / "log"
    proc = subprocess.Popen([KATAMGR, "apply", "--host-root", str(host.root)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=_env(**{faults.PAUSE_AT: f"{third}:1.0", faults.WRITE_LOG: str(log)}))
    _wait_for(lambda: log.exists() and len(log.read_text().splitlines()) >= third)
    proc.send_signal(signum)
    sent = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - sent < 1.0 + STOP_BOUND  # the paused write, then the group's end
    assert proc.returncode == 128 + signum, err
    name = signal.Signals(signum).name
    assert f"stopped by {name} while binding the GPUs" in err
    # The group under way moved whole; none after it.
    assert "kept: 0000:03:00.0, 0000:04:00.0, 0000:13:00.0 on vfio-pci" in out
    assert "`katamgr revert --host-root" in err and "`katamgr apply` again to finish" in err
    assert _bound(host.root) == ["0000:03:00.0", "0000:04:00.0", "0000:13:00.0"]
    status = subprocess.run([KATAMGR, "status", "--host-root", str(host.root), "-o", "json"],
                            capture_output=True, text=True, timeout=60, env=_env())
    assert json.loads(status.stdout)["lastRun"]["outcome"] == "interrupted"
    # Finishing is one more apply.
    again = subprocess.run([KATAMGR, "apply", "--host-root", str(host.root)], capture_output=True, timeout=120,
                           env=_env())
    assert again.returncode == 0
    assert len(_bound(host.root)) == DGX_GPUS


def test_sigterm_cuts_a_slow_blob_download_at_once(tmp_path):
    from support.paths import EXAMPLES

    server = TrickleRegistry(EXAMPLES / "oci-layout", trickle=frozenset({"blob"}), give_up=60.0)
    try:
        host = prepare_node(materialise(find_profile("workstation-a6000"), tmp_path / "host"), layout=False)
        config = tmp_path / "kata.yaml"
        config.write_text(kata_manager_yaml(url=f"{server.host}/kata/artifacts:kata-qemu-nvidia-gpu"))
        proc = subprocess.Popen([KATAMGR, "apply", "--host-root", str(host.root), "--config", str(config)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
        _wait_for(lambda: any("/blobs/" in r for r in server.requests) or proc.poll() is not None)
        time.sleep(0.3)  # the layer threads are reading their trickles
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        out, err = proc.communicate(timeout=60)
        assert time.monotonic() - sent < STOP_BOUND, err
    finally:
        server.close()
    assert proc.returncode == Exit.TERMINATED, err
    assert "stopped by SIGTERM while setting up the Kata runtimes" in err
    assert "kept: 0000:01:00.0, 0000:01:00.1 on vfio-pci" in out  # the group bound before the download
    assert "took longer than" not in err and "retry" not in err  # a stop is not the registry's fault
    assert "katamgr revert" in err
    staging = [p for p in host.path("/opt").rglob("*") if ".staging-" in p.name]
    assert staging == []


def _apply_into_a_closed_reader(root: Path, command: str, stderr) -> subprocess.Popen:
    """``katamgr <command>`` whose stdout reader reads one line and goes away, as ``| head -1``."""
    proc = subprocess.Popen([KATAMGR, command, "--host-root", str(root)], stdout=subprocess.PIPE,
                            stderr=stderr, env=_env(PYTHONUNBUFFERED="1"))
    assert proc.stdout is not None
    proc.stdout.readline()
    proc.stdout.close()
    proc.wait(timeout=120)
    return proc


def test_apply_into_head_binds_every_group_and_keeps_its_exit_code(tmp_path):
    host = materialise(find_profile("dgx-h100"), tmp_path / "node")
    # `katamgr apply 2>&1 | head -1`: the progress lines and the report share the closed pipe.
    proc = _apply_into_a_closed_reader(host.root, "apply", subprocess.STDOUT)
    assert proc.returncode == 0
    assert len(_bound(host.root)) == DGX_GPUS


def test_revert_into_head_reverts_and_says_nothing_about_the_pipe(tmp_path):
    host = materialise(find_profile("dgx-h100"), tmp_path / "node")
    assert subprocess.run([KATAMGR, "apply", "--host-root", str(host.root)], capture_output=True,
                          timeout=120, env=_env()).returncode == 0
    with (tmp_path / "stderr").open("w") as err:
        proc = _apply_into_a_closed_reader(host.root, "revert", err)
    text = (tmp_path / "stderr").read_text()
    assert proc.returncode == 0, text
    assert "BrokenPipe" not in text and "Exception ignored" not in text
    assert _bound(host.root) == []


def test_a_signal_during_a_revert_finishes_that_step_and_running_it_again_finishes(tmp_path):
    host = materialise(find_profile("dgx-h100"), tmp_path / "node")
    assert subprocess.run([KATAMGR, "apply", "--host-root", str(host.root)], capture_output=True, timeout=120,
                          env=_env()).returncode == 0
    log = tmp_path / "log"
    # The first write point of the revert: removing the CDI specs (the devices' step comes after).
    proc = subprocess.Popen([KATAMGR, "revert", "--host-root", str(host.root)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=_env(**{faults.PAUSE_AT: "1:1.0", faults.WRITE_LOG: str(log)}))
    _wait_for(lambda: log.exists() and log.read_text().strip())
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == Exit.INTERRUPTED, err
    assert "stopped by SIGINT before the revert finished" in err
    assert "run `katamgr revert` again to finish" in err
    assert "removed /var/run/cdi/" in out  # the step under way finished whole
    assert len(_bound(host.root)) == DGX_GPUS  # the step after it never started
    again = subprocess.run([KATAMGR, "revert", "--host-root", str(host.root)], capture_output=True, text=True,
                           timeout=120, env=_env())
    assert again.returncode == 0, again.stderr
    assert not host.path("/var/lib/kata-sandbox-manager").exists()
