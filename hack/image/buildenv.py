"""The image builder's surroundings: where it is, its log, the commands it runs, its cache.

Shared by hack/image/build (build.py) and its steps: buildinputs, buildcache, buildparts,
buildrequest.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from wheels import Failure

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VENV = REPO / ".venv"
PROG = "hack/image/build"


def log(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kata-sandbox-manager" / "images"


def run(cmd: list[str], *, cwd: Path | None = None, env: dict | None = None,
        what: str | None = None) -> str:
    # Its own process group: when this build is interrupted, the command and every process
    # it started (mmdebstrap's dpkg and hooks) are stopped before the temp dir is removed.
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,  # noqa: S603
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate()
    except BaseException:
        stop_group(proc)
        raise
    if proc.returncode:
        lines = (stdout + stderr).strip().splitlines()
        where = ""
        if len(lines) > 30:
            saved = cache_root() / "failed-build.log"
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_text("\n".join(lines) + "\n")
            where = f" (all of its output: {saved})"
        raise Failure(f"{what or cmd[0]} failed (exit {proc.returncode}){where}:\n"
                      + "\n".join(lines[-30:]))
    return stdout


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the command's process group (mmdebstrap cleans up on it), SIGKILL after
    30 s."""
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
