"""Every module of the repo is at most 450 lines (the house rule: small modules, one job
each): the Python modules (the generated protobuf stubs, ``*_pb2*.py``, aside), hack's Go
files and the chart's template helpers (``*.tpl``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIMIT = 450


def _code_files() -> list[str]:
    # What git tracks or would track (not ignored): the repo's own files, not a venv's.
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py", "*.go", "*.tpl"],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=60,
    ).stdout.split()
    return sorted(f for f in listed if (REPO / f).is_file() and "_pb2" not in Path(f).name)


def _over() -> dict[str, int]:
    out = {}
    for name in _code_files():
        lines = len((REPO / name).read_text(errors="replace").splitlines())
        if lines > LIMIT:
            out[name] = lines
    return out


def test_the_files_are_found():
    found = _code_files()
    assert "katamgr/cli.py" in found
    assert "hack/kata/oracle/main.go" in found
    assert "deploy/helm/kata-sandbox-manager/templates/_args.tpl" in found


def test_no_module_is_over_450_lines():
    over = _over()
    assert not over, "split by job: " + ", ".join(f"{k} ({v} lines)" for k, v in sorted(over.items()))
