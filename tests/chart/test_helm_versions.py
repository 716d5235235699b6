"""The chart, the image and the Python package describe one release.

No Helm engine here: these read the files as a release script would.
"""

from __future__ import annotations

import re
import tomllib

import yaml
from support.paths import REPO

CHART = REPO / "deploy" / "helm" / "kata-sandbox-manager"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
DOCKERIGNORE = REPO / "deploy" / "Dockerfile.dockerignore"


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def stages(dockerfile: str) -> list[list[str]]:
    """Instructions of each build stage, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", dockerfile)
    out: list[list[str]] = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            out.append([])
        if out:
            out[-1].append(line)
    return out


def test_package_chart_and_image_versions_agree():
    package = pyproject()["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    image_version = yaml.safe_load((CHART / "values.yaml").read_text())["image"]["tag"]
    assert chart["appVersion"] == package, "Chart.yaml appVersion must be the package version"
    # Empty means "the chart's appVersion"; a pinned tag must still be this release.
    assert image_version in ("", package)


def test_image_is_multi_stage_with_host_tools_and_no_compiler():
    builder, runtime = stages(DOCKERFILE.read_text())
    assert builder[0].endswith("AS builder")
    assert "${PYTHON_IMAGE}" in runtime[0]
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in DOCKERFILE.read_text()
    runtime_text = "\n".join(runtime)
    apt = next(line for line in runtime if "apt-get install" in line).split()
    assert {"hwdata", "kmod"} <= set(apt)
    assert not re.search(r"\b(gcc|g\+\+|build-essential|clang|make)\b", runtime_text)
    assert "COPY --from=builder" in runtime_text


def test_image_entrypoint_is_a_console_script_of_the_package():
    scripts = pyproject()["project"]["scripts"]
    entrypoint = next(line for line in stages(DOCKERFILE.read_text())[-1]
                      if line.startswith("ENTRYPOINT"))
    assert entrypoint == 'ENTRYPOINT ["katamgr"]'
    assert {"katamgr", "sandbox-device-plugin"} <= set(scripts)


def test_build_context_sends_what_the_dockerfile_copies():
    allowed = {line[1:].rstrip("/") for line in DOCKERIGNORE.read_text().splitlines()
               if line.startswith("!")}
    copied = []
    for stage in stages(DOCKERFILE.read_text()):
        for line in stage:
            if line.startswith("COPY ") and "--from=" not in line:
                copied.extend(line.split()[1:-1])
    assert copied, "the Dockerfile copies nothing from the context"
    for source in copied:
        assert source in allowed, f"{source} is copied but Dockerfile.dockerignore leaves it out"
        assert (REPO / source).exists(), f"{source} is not in the repo"
    # Every import package the distribution ships is in the image.
    packages = pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in packages} <= set(copied)
