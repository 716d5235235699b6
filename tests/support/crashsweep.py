"""The crash-safety sweep: kill katamgr at each write point, then check that it converges.

A simulated node with GPUs, a Kata config (artifacts from the shipped OCI layout) and
a containerd config. For each write point N of ``katamgr apply`` (or ``revert``), a
fresh node is taken to the state before the command, the command runs in a forked
child with ``KATAMGR_CRASH_AT=N`` (``gpunode.host.faults``: SIGKILL at the N-th write,
as a power cut or an OOM kill would), and then either ``apply`` or ``revert`` runs
uninterrupted. The node must then be exactly what an uninterrupted run gives: same
files, same content, same drivers, nothing left over (temp files, staging dirs, lock
files). ``bench/reliability.py`` (its crash points) runs every point; the test suite
runs a sample.

The child is forked rather than started afresh: a fork costs milliseconds where a new
interpreter costs a second of imports, and the kill is the same real SIGKILL.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import katamgr.cluster  # noqa: F401 - imported once here, so each forked run starts warm
from gpunode.host import faults
from gpunode.kataclasses import GPU, GPU_SNP
from katamgr.cli import main as katamgr_main
from nodesim.marker import MARKER
from nodesim.materialise import materialise
from nodesim.profiles import find_profile
from support.kataconfig import kata_manager_yaml

REPO = Path(__file__).resolve().parents[2]
LAYOUT = REPO / "examples" / "oci-layout"
CONTAINERD = (REPO / "katamgr" / "data" / "demo" / "containerd-config.toml").read_bytes()
CONFIG = kata_manager_yaml((GPU, GPU_SNP), selectors={})
# Values that differ between two uninterrupted runs (file times, which pid): masked.
_VOLATILE = (re.compile(rb'"mtime_ns": \d+'), re.compile(rb'"pid": \d+'),
             re.compile(rb'"since": "[^"]*"'))
# The run journal records the last run's history (which steps it took), not the node's
# state: a follow-up after a kill takes fewer steps than a run on a fresh node. Its
# presence is compared, its content is not.
_HISTORY = ("var/lib/kata-sandbox-manager/run.json",)


@dataclass
class Sweep:
    command: str  # "apply" or "revert"
    points: list[str] = field(default_factory=list)  # the labels, in order
    survived: dict[str, list[int]] = field(default_factory=dict)  # follow-up -> points that converged
    failures: list[str] = field(default_factory=list)

    def figure(self, follow_up: str) -> str:
        return f"{len(self.survived.get(follow_up, []))}/{len(self.points)}"


def new_node(directory: Path, profile: str = "workstation-a6000") -> Path:
    host = materialise(find_profile(profile), directory / "host")
    shutil.copytree(LAYOUT, host.path("/opt/kata-artifacts/layout"))
    host.path("/etc/containerd").mkdir(parents=True)
    host.path("/etc/containerd/config.toml").write_bytes(CONTAINERD)
    (directory / "kata-manager.yaml").write_text(CONFIG)
    return host.root


def run(root: Path, command: str, crash_at: int | None = None, log: Path | None = None,
        fail_at: str | None = None, output: Path | None = None) -> int:
    """``katamgr COMMAND`` on the node in a forked child; its exit status (-9: killed).
    ``fail_at``: ``N:EROFS`` or ``N:ENOSPC``, the N-th write fails so; ``output``: where its
    stdout and stderr go (else nowhere)."""
    args = [command, "--host-root", str(root), "--config", str(root.parent / "kata-manager.yaml")]
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 70
        try:
            os.environ.pop(faults.CRASH_AT, None)
            os.environ.pop(faults.WRITE_LOG, None)
            os.environ.pop(faults.FAIL_AT, None)
            if fail_at is not None:
                os.environ[faults.FAIL_AT] = fail_at
            if crash_at is not None:
                os.environ[faults.CRASH_AT] = str(crash_at)
            if log is not None:
                os.environ[faults.WRITE_LOG] = str(log)
            os.environ["KUBECONFIG"] = "/nonexistent"
            faults._seen = 0
            sink = os.open(output if output is not None else os.devnull, os.O_WRONLY | os.O_CREAT, 0o600)
            os.dup2(sink, 1)
            os.dup2(sink, 2)
            code = katamgr_main(args)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def snapshot(root: Path) -> dict[str, bytes | str]:
    """Every path under the node's root: file bytes (volatile values masked), link
    targets, dirs; the simulator's own marker aside. An empty dir with an ordinary name
    (``/run/nvidia/validations`` after revert) holds nothing and is not compared; an
    empty hidden one (``.kata-qemu-nvidia-gpu.staging-*``) is a leftover and is."""
    state: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if rel == MARKER:
                continue
            if path.is_symlink():
                state[rel] = "-> " + os.readlink(path)
            elif rel in _HISTORY:
                state[rel] = "<run journal>"
            elif path.is_file():
                data = path.read_bytes()
                for pattern in _VOLATILE:
                    data = pattern.sub(b"<volatile>", data)
                state[rel] = data
            elif not path.is_dir():
                state[rel] = "<special>"  # a FIFO or device node: never read
            elif name.startswith(".") or any(path.iterdir()):
                state[rel] = "<dir>"
    return {k: v for k, v in state.items() if v != "<dir>" or _holds_something(k, state)}


def _holds_something(directory: str, state: dict) -> bool:
    prefix = directory + "/"
    return Path(directory).name.startswith(".") or any(
        k.startswith(prefix) and v != "<dir>" for k, v in state.items())


def diff(got: dict, want: dict) -> str:
    extra = sorted(got.keys() - want.keys())
    missing = sorted(want.keys() - got.keys())
    changed = sorted(k for k in got.keys() & want.keys() if got[k] != want[k])
    parts = []
    for label, items in (("left behind", extra), ("missing", missing), ("different", changed)):
        if items:
            parts.append(f"{label}: {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}")
    return "; ".join(parts)


@contextmanager
def workspace() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="crash-sweep-"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def references(base: Path) -> dict[str, dict]:
    """What uninterrupted runs leave: after apply, and after apply then revert."""
    root = new_node(base / "reference")
    assert run(root, "apply") == 0, "an uninterrupted apply failed"
    applied = snapshot(root)
    assert run(root, "revert") == 0, "an uninterrupted revert failed"
    return {"apply": applied, "revert": snapshot(root)}


def write_points(base: Path, command: str) -> list[str]:
    root = new_node(base / f"count-{command}")
    if command == "revert":
        assert run(root, "apply") == 0
    log = base / f"points-{command}.log"
    assert run(root, command, log=log) == 0
    return [line.split(" ", 1)[1] for line in log.read_text().splitlines()]


def sweep(command: str, points: list[int] | None = None,
          follow_ups: tuple[str, ...] = ("apply", "revert")) -> Sweep:
    """Kill ``command`` at each write point (or those in ``points``, 1-based), follow
    with each of ``follow_ups``, and compare with the uninterrupted result."""
    with workspace() as base:
        want = references(base)
        result = Sweep(command, write_points(base, command))
        chosen = points or list(range(1, len(result.points) + 1))
        for n in chosen:
            for follow_up in follow_ups:
                directory = base / f"{command}-{n}-{follow_up}"
                directory.mkdir()
                root = new_node(directory)
                if command == "revert":
                    assert run(root, "apply") == 0
                status = run(root, command, crash_at=n)
                if status != -signal.SIGKILL:
                    result.failures.append(f"{command} point {n} ({result.points[n - 1]}): "
                                           f"expected a kill, the run exited {status}")
                    continue
                follow = run(root, follow_up)
                problem = diff(snapshot(root), want[follow_up]) if follow == 0 else f"exit {follow}"
                if problem:
                    result.failures.append(f"kill at {command} point {n} ({result.points[n - 1]}), "
                                           f"then {follow_up}: {problem}")
                else:
                    result.survived.setdefault(follow_up, []).append(n)
                shutil.rmtree(directory, ignore_errors=True)
        if points is not None:
            result.points = [result.points[n - 1] for n in chosen]
        return result


def fault_sweep(command: str, error: str, points: list[int]) -> Sweep:
    """Fail the write at each of ``points`` of ``command`` with ``error`` (EROFS, ENOSPC),
    then revert with nothing failing. The failed run must exit 1 (or 3: a runtime class alone
    failed) with its failure said in a sentence, never an unexpected error, and name the
    ``katamgr revert`` that undoes what it kept; the revert then leaves the node exactly as
    an uninterrupted apply and revert do."""
    with workspace() as base:
        want = references(base)
        result = Sweep(command, write_points(base, command))
        for n in points:
            directory = base / f"{command}-{error}-{n}"
            directory.mkdir()
            root = new_node(directory)
            if command == "revert":
                assert run(root, "apply") == 0
            output = directory / "output"
            status = run(root, command, fail_at=f"{n}:{error}", output=output)
            said = output.read_text() if output.exists() else ""
            where = f"{error} at {command} point {n} ({result.points[n - 1]})"
            if status not in (1, 3) or "unexpected" in said or "Traceback" in said:
                result.failures.append(f"{where}: exit {status}: {said[-600:]}")
                continue
            if command == "apply" and status == 1 and "changed:" in said and "katamgr revert" not in said:
                result.failures.append(f"{where}: changes kept but no `katamgr revert` named: {said[-600:]}")
                continue
            follow = run(root, "revert")
            problem = diff(snapshot(root), want["revert"]) if follow == 0 else f"exit {follow}"
            if problem:
                result.failures.append(f"{where}, then revert: {problem}")
            else:
                result.survived.setdefault("revert", []).append(n)
            shutil.rmtree(directory, ignore_errors=True)
        result.points = [result.points[n - 1] for n in points]
        return result


def spread(total: int, count: int) -> list[int]:
    """``count`` points spread over 1..total, first and last included."""
    if total <= count:
        return list(range(1, total + 1))
    return sorted({1 + round(i * (total - 1) / (count - 1)) for i in range(count)})


def to_json(result: Sweep) -> str:
    return json.dumps({"command": result.command, "points": len(result.points),
                       "survived": {k: len(v) for k, v in result.survived.items()},
                       "failures": result.failures}, indent=2)
