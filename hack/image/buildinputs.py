"""What decides an image: the files, versions and sources that key the cache, the
architectures asked, the chart's image reference."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform as host_platform
import shutil
import tomllib
from pathlib import Path

import wheels
from buildenv import HERE, REPO, VENV, run
from recipe import PLATFORMS, Platform
from wheels import Failure

CHART = REPO / "deploy" / "helm" / "kata-sandbox-manager"
# The import packages the wheel ships, as pyproject.toml lists them for setuptools.
PACKAGES = tuple(p.rstrip("*") for p in tomllib.loads((REPO / "pyproject.toml").read_text())
                 ["tool"]["setuptools"]["packages"]["find"]["include"])
# What goes into the wheel (the git-tracked files of these) and what decides the image.
INPUTS = (*PACKAGES, "pyproject.toml", "README.md",
          "deploy/helm/kata-sandbox-manager/Chart.yaml",
          "deploy/helm/kata-sandbox-manager/values.yaml", "hack/image", "requirements")
# Taken tracked or not: this builder, and the lock it installs by (an edit of either is in
# the key before it is committed).
UNTRACKED_INPUTS = (HERE, wheels.REQUIREMENTS)
PAUSE_REF = "registry.k8s.io/pause:3.10.1"
MIRROR = os.environ.get("KSM_IMAGE_MIRROR", "http://deb.debian.org/debian")
SECURITY = os.environ.get("KSM_IMAGE_SECURITY_MIRROR", "http://deb.debian.org/debian-security")


def input_files() -> list[str]:
    """The git-tracked files of INPUTS, and every file of UNTRACKED_INPUTS, tracked or not."""
    out = run(["git", "-C", str(REPO), "ls-files", "-z", "--", *INPUTS], what="git ls-files")
    files = {p for p in out.split("\0") if p and (REPO / p).is_file()}
    files.update(str(p.relative_to(REPO)) for d in UNTRACKED_INPUTS for p in d.rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts)
    return sorted(files)


def source_date_epoch() -> int:
    """The time of the last commit that touched an input (uncommitted edits are in the
    key, not in the time), so commits elsewhere in the repository keep the cache."""
    if os.environ.get("SOURCE_DATE_EPOCH", "").isdigit():
        return int(os.environ["SOURCE_DATE_EPOCH"])
    out = run(["git", "-C", str(REPO), "log", "-1", "--format=%ct", "--", *INPUTS],
              what="git log").strip()
    return int(out) if out else 0


def chart_ref() -> str:
    """The image the chart renders by default: templates/_names.tpl's ksm.image,
    repository/name:(tag or appVersion)."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's: a cached call is quick
    chart = yaml.load((CHART / "Chart.yaml").read_text(), Loader=loader)
    image = yaml.load((CHART / "values.yaml").read_text(), Loader=loader)["image"]
    tag = image.get("tag") or chart["appVersion"]
    return f"{image['repository']}/{image['name']}:{tag}"


def host_arch() -> Platform:
    machine = host_platform.machine()
    for candidate in PLATFORMS.values():
        if candidate.machine == machine:
            return candidate
    raise Failure(f"this machine's architecture {machine} is none of {', '.join(PLATFORMS)}")


def parse_arches(text: str | None) -> list[Platform]:
    if not text:
        return [host_arch()]
    names = list(PLATFORMS) if text == "all" else [a.strip() for a in text.split(",") if a.strip()]
    unknown = [n for n in names if n not in PLATFORMS]
    if unknown or not names:
        raise Failure(f"--arch {text!r}: {', '.join(unknown) or 'none'} is not one of "
                      f"{', '.join(PLATFORMS)} (or all)")
    # The index lists them in one order, whatever order they were asked in.
    return [PLATFORMS[n] for n in PLATFORMS if n in names]


def go_binary() -> str | None:
    found = shutil.which("go")
    if found:
        return found
    for candidate in (Path("/usr/local/go/bin/go"), VENV / "bin" / "go"):
        if candidate.exists():
            return str(candidate)
    return None


def go_version(go: str | None) -> str:
    if go is None:
        return "none"
    version_file = Path(go).resolve().parents[1] / "VERSION"
    if version_file.is_file():
        return version_file.read_text().splitlines()[0]
    return run([go, "env", "GOVERSION"], what="go env").strip()


@functools.cache
def file_hash(rel: str) -> bytes:
    return hashlib.sha256((REPO / rel).read_bytes()).digest()


def digest_of(inputs: dict, files: list[str]) -> str:
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode())
    for rel in files:
        digest.update(f"\0{rel}\0".encode())
        digest.update(file_hash(rel))
    return digest.hexdigest()[:24]
