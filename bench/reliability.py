"""Reliability figures: crash points survived, concurrent runs, hostile inputs refused.

1. Crash points: for every write point N of ``katamgr apply`` (and of ``revert``) on a
   simulated node (a graphics GPU with its audio function, two Kata runtime classes
   from an OCI layout, a containerd config), kill the command there with SIGKILL, run
   ``apply`` (or ``revert``) to the end, and compare the node file by file with what an
   uninterrupted run leaves (``tests/support/crashsweep.py``).
2. Concurrent runs: three ``katamgr apply`` and one ``revert`` started together (real
   processes), then one more ``revert``: the node must be exactly as one apply and one
   revert leave it (no GPU stranded on vfio-pci, no record lost).
3. Hostile inputs: each bad input is refused with the expected exit code, and leaves the
   node either untouched or, where the failure comes mid-install, without litter (a
   ``revert`` then gives exactly the reverted node).

Prints N/N per line; exit 1 on any miss.

    .venv/bin/python bench/reliability.py [--trials 10]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from support import crashsweep as cs  # noqa: E402

KATAMGR = str(Path(sys.executable).parent / "katamgr")
STATE = "var/lib/kata-sandbox-manager"


def crash_points() -> int:
    missed = 0
    for command in ("apply", "revert"):
        started = time.monotonic()
        result = cs.sweep(command)
        for follow_up in ("apply", "revert"):
            print(f"crash points: kill during {command:<6} then {follow_up:<6} converged "
                  f"{result.figure(follow_up):>7} ({time.monotonic() - started:.0f} s)")
        for failure in result.failures:
            print(f"  MISS: {failure}")
        missed += len(result.failures)
    return missed


def concurrent_runs(trials: int) -> int:
    with cs.workspace() as base:
        want = cs.references(base)["revert"]
        good = 0
        for trial in range(trials):
            root = cs.new_node(base / f"trial-{trial}")
            config = str(root.parent / "kata-manager.yaml")
            env = {**os.environ, "KUBECONFIG": "/nonexistent"}
            codes: list[int] = []

            def run(command: str, root=root, config=config, env=env, codes=codes) -> None:
                done = subprocess.run([KATAMGR, command, "--host-root", str(root), "--config", config],
                                      capture_output=True, env=env, timeout=300)
                codes.append(done.returncode)

            threads = [threading.Thread(target=run, args=(c,)) for c in ("apply", "apply", "apply", "revert")]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            final = cs.run(root, "revert")
            problem = cs.diff(cs.snapshot(root), want) if final == 0 else f"final revert exit {final}"
            if codes != [0] * 4 or problem:
                print(f"  MISS: trial {trial}: exit codes {codes}; {problem}")
            else:
                good += 1
            shutil.rmtree(root.parent, ignore_errors=True)
    print(f"concurrent runs: 3 applies + 1 revert, then a revert, converged {good}/{trials}")
    return trials - good


def _layout(root: Path) -> Path:
    return root / "opt/kata-artifacts/layout"


def _blob_files(root: Path) -> list[Path]:
    return [p for p in (_layout(root) / "blobs/sha256").iterdir() if p.stat().st_size > 1000]


def _set_url(root: Path, url: str) -> None:
    config = root.parent / "kata-manager.yaml"
    config.write_text(config.read_text().replace(
        "oci-layout:///opt/kata-artifacts/layout:kata-qemu-nvidia-gpu-snp", url))


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _immutable(path: Path) -> None:
    subprocess.run(["chattr", "+i", str(path)], check=True)


HOSTILE: dict[str, tuple[int, Callable[[Path], None]]] = {
    "containerd config is not TOML": (2, lambda r: (r / "etc/containerd/config.toml").write_text("[plugins\n")),
    "containerd config is immutable": (2, lambda r: _immutable(r / "etc/containerd/config.toml")),
    "artifacts dir holds someone else's files": (2, lambda r: (
        (r / "opt/nvidia-gpu-operator/artifacts/runtimeclasses/kata-qemu-nvidia-gpu").mkdir(parents=True),
        (r / "opt/nvidia-gpu-operator/artifacts/runtimeclasses/kata-qemu-nvidia-gpu/shim").write_text("x"))),
    "config has a duplicate key": (2, lambda r: (r.parent / "kata-manager.yaml").write_text(
        (r.parent / "kata-manager.yaml").read_text() + "artifactsDir: /opt/other\n")),
    "oci-layout marker is /dev/zero": (1, lambda r: ((_layout(r) / "oci-layout").unlink(),
                                                      os.symlink("/dev/zero", _layout(r) / "oci-layout"))),
    "index.json is a FIFO": (1, lambda r: _fifo(_layout(r) / "index.json")),
    "a blob is a FIFO": (1, lambda r: _fifo(_blob_files(r)[0])),
    "a blob lies about its digest": (1, lambda r: _blob_files(r)[0].write_bytes(
        b"\0" * _blob_files(r)[0].stat().st_size)),
    "the tag does not exist": (1, lambda r: _set_url(r, "oci-layout:///opt/kata-artifacts/layout:no-such-tag")),
    "the registry is down": (1, lambda r: _set_url(r, "127.0.0.1:9/kata/artifacts:v1")),
}


def hostile_inputs() -> int:
    with cs.workspace() as base:
        reverted = cs.references(base)["revert"]
        good = 0
        for number, (name, (expected, prepare)) in enumerate(HOSTILE.items()):
            root = cs.new_node(base / f"hostile-{number}")
            prepare(root)
            before = cs.snapshot(root)
            try:
                code = cs.run(root, "apply")
            finally:
                subprocess.run(["chattr", "-i", str(root / "etc/containerd/config.toml")], check=False)
            after = {k: v for k, v in cs.snapshot(root).items()
                     if k != f"{STATE}/node.lock" and k not in ({"var", "var/lib", STATE} - before.keys())}
            untouched = after == before
            clean = untouched or (cs.run(root, "revert") == 0 and not _litter(cs.snapshot(root), reverted))
            if code == expected and clean:
                good += 1
                print(f"  refused (exit {code}{', nothing changed' if untouched else ', no litter'}): {name}")
            else:
                print(f"  MISS: {name}: exit {code} (want {expected}), "
                      f"{'untouched' if untouched else 'changed'}, {'clean' if clean else 'litter'}")
            shutil.rmtree(root.parent, ignore_errors=True)
    print(f"hostile inputs refused {good}/{len(HOSTILE)}")
    return len(HOSTILE) - good


def _litter(snapshot: dict, reverted: dict) -> list[str]:
    """Hidden leftovers of ours (temp files, staging dirs) the reverted node lacks."""
    return [k for k in snapshot.keys() - reverted.keys()
            if any(part.startswith(".") and ("tmp" in part or "staging" in part or "removing" in part
                                             or part.endswith(".lock")) for part in k.split("/"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10, help="concurrent-run trials (default 10)")
    args = parser.parse_args(argv)
    missed = crash_points() + concurrent_runs(args.trials) + hostile_inputs()
    print(json.dumps({"missed": missed}))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
