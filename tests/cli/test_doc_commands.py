"""Every command the README and docs/ show still runs as written: the read-only katamgr
commands (plan, demo) are run and must exit 0; every other command's program and every
repository file it names must exist (a cluster's commands cannot run here; the local
cluster's flow is run by tests/controlplane/test_readme_flow.py)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO

from katamgr.exitcodes import Exit

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent
# Programs a reader runs that are not files of this repository.
OUTSIDE = {"kubectl", "helm", "bash", "grep", "sudo", ".", "cd", "docker", "skopeo", "REQUIRE_INTEGRATION=1",
           "python3", "pipx"}
# The virtualenvs the docs have a reader make: this checkout's, and docs/operating.md's
# install without .ci/setup (its `python3 -m venv /opt/katamgr`).
VENVS = (".venv/bin/", "/opt/katamgr/bin/")
READ_ONLY = {"plan", "demo"}


def commands() -> list[tuple[str, str]]:
    """(where, command) for every command line of every ```sh block, continuation lines
    joined, comments and `#   output` lines dropped, `a && b` split."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for block in re.findall(r"```(?:sh|bash)\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                for part in line.split(" && "):
                    out.append((doc.relative_to(REPO).as_posix(), part.strip()))
    return out


def words(command: str) -> list[str]:
    try:
        tokens = shlex.split(command, comments=True)
    except ValueError:  # an unbalanced quote in a comment
        tokens = shlex.split(command.split(" #")[0])
    return tokens


ALL = commands()


def test_the_docs_show_commands():
    assert len(ALL) > 30
    assert any("katamgr demo" in c for _, c in ALL)
    # Programs of /opt/katamgr/bin are run only where the docs made that virtualenv.
    if any(c.split()[0].startswith(VENVS[1]) or c.startswith(f"sudo {VENVS[1]}") for _, c in ALL):
        assert any(c == "python3 -m venv /opt/katamgr" for _, c in ALL)


@pytest.mark.parametrize(("where", "command"), ALL, ids=[f"{w}:{c[:60]}" for w, c in ALL])
def test_a_documented_command_runs_as_written(where, command, tmp_path):
    for piece in command.split("|"):
        argv = words(piece)
        if not argv:
            continue
        if argv[0] == "sudo":
            argv = argv[1:]
        program = argv[0]
        if program.endswith("katamgr"):
            assert program == "katamgr" or program.startswith(VENVS), f"{where}: {command}"
            if argv[1] in READ_ONLY and not any("<" in a for a in argv):
                result = subprocess.run([str(BIN / "katamgr"), *argv[1:]], cwd=REPO, capture_output=True,
                                        text=True, timeout=120, env={**os.environ, "HOME": str(tmp_path)})
                # plan exits 4 when it lists problems (no GPU on the machine running this suite).
                ok = (Exit.OK, Exit.PROBLEMS) if argv[1] == "plan" else (Exit.OK,)
                assert result.returncode in ok, f"{where}: {command}\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
            continue
        if program not in OUTSIDE and not program.startswith(VENVS):
            assert (REPO / program).is_file() and os.access(REPO / program, os.X_OK), f"{where}: {command}"
        for arg in argv[1:]:
            # A repository path the command names must be there.
            if re.match(r"^(examples|deploy|bench|hack|tests|katamgr|docs|\.ci)/", arg):
                assert (REPO / arg).exists(), f"{where}: {command}: no {arg}"


def test_the_readme_is_at_most_200_lines():
    """The README is the way in; detail lives in docs/*.md, linked from it."""
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
