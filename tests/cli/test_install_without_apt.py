"""The look at a real node that docs/operating.md gives without .ci/setup (which apt-installs
the test machine's packages): this package's wheel installed into a virtualenv of its own
beside pyproject.toml's runtime dependencies and nothing else (no test extra, no apt
package), and `katamgr plan` run from it. The dependencies are this venv's installed files
(the closure of pyproject's `dependencies`, read from their metadata) linked into the new
venv, so the test needs no index; a dependency the plan path imports but pyproject does not
name fails it with ModuleNotFoundError."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from support.paths import REPO

PACKAGE = "kata-sandbox-manager"
SOURCES = ("pyproject.toml", "README.md", "katamgr", "sandbox_plugin", "gpunode", "grpcwire", "cdi", "kubeletapi", "nodesim")


def runtime_closure(name: str) -> dict[str, metadata.Distribution]:
    """The installed distributions ``name`` needs at run time (extras left out)."""
    found: dict[str, metadata.Distribution] = {}
    todo = [Requirement(r) for r in metadata.requires(name) or []]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = req.name.lower().replace("_", "-")
        if key in found:
            continue
        dist = metadata.distribution(req.name)
        found[key] = dist
        todo += [Requirement(r) for r in dist.requires or []]
    return found


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "source"
    source.mkdir()
    for name in SOURCES:  # a copy: building in the repository would leave build/ in it
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy2)(
            REPO / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                           if (REPO / name).is_dir() else {}))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--no-index", "-q", "-w", str(tmp / "dist"), str(source)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp / "dist").glob("kata_sandbox_manager-*.whl")
    env_dir = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for dist in runtime_closure(PACKAGE).values():
        for file in dist.files or []:
            if file.parts[0] == ".." or (site / file).exists():
                continue  # console scripts outside site-packages: not needed
            (site / file).parent.mkdir(parents=True, exist_ok=True)
            (site / file).symlink_to(Path(dist.locate_file(file)).resolve())
    # Without PYTHONPATH: pip would see a checkout's kata_sandbox_manager.egg-info (an editable
    # install leaves one) on the path as the package installed already, and install nothing.
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                                "--no-index", "-q", str(wheel)], capture_output=True, text=True, timeout=300,
                               env=clean)
    assert installed.returncode == 0, installed.stderr
    return env_dir


def run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(venv / "bin" / args[0]), *args[1:]], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env={**env, "HOME": str(cwd)})


def test_the_installed_package_is_the_wheel_not_this_checkout(venv, tmp_path):
    where = run(venv, "python", "-c", "import katamgr; print(katamgr.__file__)", cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert where.stdout.startswith(str(venv)), where.stdout
    # No test extra came along: the venv holds the runtime closure only.
    assert run(venv, "python", "-c", "import pytest", cwd=tmp_path).returncode != 0


def test_plan_runs_from_the_wheel_on_a_host_root(venv, tmp_path):
    simulated = run(venv, "katamgr", "simulate", "a10-server", "--into", str(tmp_path / "node"), cwd=tmp_path)
    assert simulated.returncode == 0, simulated.stderr
    plan = run(venv, "katamgr", "plan", "--host-root", str(tmp_path / "node"), cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert "nvidia.com/GA102GL_A10: 4" in plan.stdout


def test_the_other_programs_start_from_the_wheel(venv, tmp_path):
    for program in ("sandbox-device-plugin", "sandbox-dra-driver"):
        result = run(venv, program, "--help", cwd=tmp_path)
        assert result.returncode == 0, f"{program}: {result.stderr}"
