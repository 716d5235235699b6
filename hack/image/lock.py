#!/usr/bin/env python3
"""Writes requirements/image.lock: every wheel the image installs, by its sha256.

    hack/image/lock            # (re)write it from .venv's versions
    hack/image/lock --check    # exit 1 if it is not what this would write

The versions are .venv's (what the tests ran): the runtime closure of pyproject.toml's
dependencies, for each architecture of recipe.PLATFORMS, as hack/image/build freezes it.
The files are the wheels hack/image/build installs for them, fetched for the image's
CPython, glibc and architecture (wheels.wheelhouse) into the same cache, so a lock written
here needs no second download to build, and a build after it none at all: offline where the
wheelhouses are cached, from PyPI otherwise. The hashes are of those files. A pin in a file
reviewed by hand (requirements/*.txt, NVIDIA's gpu-admin-tools) is not repeated: the lock
includes that file, and the wheel fetched must be one its pin allows.

Upgrading a dependency: upgrade it in .venv, run this, review the diff (every new hash is a
file the image will run), and commit the lock with the change that needed it.
tests/image/test_lock.py fails while .venv and the lock differ.
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VENV = REPO / ".venv"
VENV_PYTHON = VENV / "bin" / "python"
# importlib.metadata must read .venv's distributions: run under .venv's Python.
if VENV_PYTHON.exists() and Path(sys.prefix).resolve() != VENV.resolve():
    os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), str(Path(__file__)), *sys.argv[1:]])

sys.path.insert(0, str(HERE))
# hack/image's modules, after the re-exec
import wheels  # noqa: E402
from buildenv import cache_root  # noqa: E402
from recipe import GLIBC, PLATFORMS, PYTHON, Platform  # noqa: E402
from wheels import LOCK, REQUIREMENTS, Failure, Pin  # noqa: E402

PROG = "hack/image/lock"


def log(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def reviewed_files() -> list[Path]:
    """The pins written by hand after a review, which the lock includes as they are."""
    return sorted(p for p in REQUIREMENTS.glob("*.txt") if p.resolve() != LOCK.resolve())


def reviewed_pins() -> dict[str, Pin]:
    pins: dict[str, Pin] = {}
    for path in reviewed_files():
        pins.update(wheels.read_lock(path))
    return pins


def check_reviewed(house: Path, reviewed: dict[str, Pin]) -> None:
    """A fetched wheel of a reviewed requirement is a file its pin allows (the rest is what
    the lock is about to record)."""
    for wheel in house.glob("*.whl"):
        name, version = wheels.wheel_pin(wheel)
        pin = reviewed.get(name)
        if pin is None:
            continue
        digest = wheels.sha256_file(wheel)
        if pin.version != version or digest not in pin.hashes:
            raise Failure(f"refusing {wheel.name} (sha256 {digest}): {pin.source} pins "
                          f"{name}=={pin.version} as sha256 {', '.join(sorted(pin.hashes))}")


def collect(platforms: list[Platform]) -> tuple[dict[str, dict], dict[str, Pin], dict]:
    """name==version -> {"platforms": [arch...], "files": [(file name, sha256)...]} (the
    platforms' order, each file once), for every pin of every platform's closure; the
    reviewed pins; and each platform's (frozen list, wheelhouse), by arch."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    dependencies = pyproject["project"]["dependencies"]
    pip = wheels.pip_version()
    root = cache_root()
    reviewed = reviewed_pins()
    found: dict[str, dict] = {}
    houses = {}
    for platform in platforms:
        frozen = wheels.frozen_requirements(dependencies, platform, root)
        house = wheels.wheelhouse(frozen, pip, platform, root, log,
                                  check=lambda d: check_reviewed(d, reviewed))
        check_reviewed(house, reviewed)  # a cached one too
        if (house / wheels.BUILT_HERE).is_file():
            built = (house / wheels.BUILT_HERE).read_text().split()
            raise Failure(f"the index has no {platform.name} wheel of {', '.join(built)}: the "
                          "wheelhouse built them from their sdists, and the lock takes only "
                          "files the index serves (a wheel built here has this machine's hash)")
        by_pin = {}
        for wheel in sorted(house.glob("*.whl")):
            name, version = wheels.wheel_pin(wheel)
            if name != wheels.INSTALLER:
                by_pin.setdefault(f"{name}=={version}", []).append(wheel)
        if sorted(by_pin) != sorted(frozen) or any(len(w) != 1 for w in by_pin.values()):
            raise Failure(f"the {platform.name} wheelhouse {house} does not hold one wheel of "
                          f"each of .venv's runtime dependencies: remove it to fetch again")
        for pin, (wheel,) in by_pin.items():
            entry = found.setdefault(pin, {"platforms": [], "files": []})
            entry["platforms"].append(platform.arch)
            digest = wheels.sha256_file(wheel)
            if all(digest != d for _, d in entry["files"]):
                entry["files"].append((wheel.name, digest))
        houses[platform.arch] = (frozen, house)
        log(f"{platform.name}: {len(frozen)} wheels in {house}")
    for pin in found:
        name, version = pin.split("==")
        if name in reviewed and reviewed[name].version != version:
            raise Failure(f".venv has {pin}, but {reviewed[name].source} pins "
                          f"{name}=={reviewed[name].version}; run: bash .ci/setup")
    return found, reviewed, houses


def marker(arches: list[str], platforms: list[Platform]) -> str:
    """The PEP 508 marker of a pin only some architectures need (the closure's markers,
    evaluated for each, differ): none where every one does."""
    if len(arches) == len(platforms):
        return ""
    machines = [p.machine for p in platforms if p.arch in arches]
    return " ; " + " or ".join(f'platform_machine == "{m}"' for m in machines)


def render(found: dict[str, dict], reviewed: dict[str, Pin], platforms: list[Platform]) -> str:
    names = ", ".join(p.name for p in platforms)
    python = ".".join(map(str, PYTHON))
    lines = [
        f"# The image's Python dependencies, every wheel by its sha256: what {PROG} wrote from",
        "# .venv's versions (the runtime closure of pyproject.toml's dependencies, no test extras)",
        f"# and the wheels fetched for CPython {python} on {names}",
        f"# (manylinux, glibc {GLIBC[0]}.{GLIBC[1]} or older). Do not edit: upgrade .venv, run {PROG},",
        "# review the diff. The image installs exactly these files (pip install --require-hashes",
        "# --no-deps, hack/image/recipe.py), .ci/setup installs .venv's from it, and",
        "# tests/image/test_lock.py keeps it equal to .venv. Each pin's files are named above it,",
        "# in the order of its hashes.",
    ]
    if reviewed:
        lines += ["#", "# Pins reviewed by hand, kept in their own files:"]
        lines += [f"-r {path.relative_to(LOCK.parent)}" for path in reviewed_files()]
    for pin in sorted(found):
        name = pin.split("==")[0]
        if name in reviewed:
            continue
        entry = found[pin]
        lines.append("")
        lines += [f"# {file}" for file, _ in entry["files"]]
        hashes = [f"    --hash=sha256:{digest}" for _, digest in entry["files"]]
        lines.append(f"{pin}{marker(entry['platforms'], platforms)} \\")
        lines += [h + " \\" for h in hashes[:-1]] + hashes[-1:]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help=f"exit 1 if {LOCK.relative_to(REPO)} is not what this would write")
    args = parser.parse_args()
    platforms = list(PLATFORMS.values())
    found, reviewed, houses = collect(platforms)
    text = render(found, reviewed, platforms)
    current = LOCK.read_text() if LOCK.is_file() else None
    if args.check:
        if text != current:
            log(f"{LOCK.relative_to(REPO)} is stale: run {PROG}")
            return 1
        log(f"{LOCK.relative_to(REPO)} is up to date")
        return 0
    if text == current:
        log(f"{LOCK.relative_to(REPO)} is up to date")
        return 0
    tmp = LOCK.with_name(f".{LOCK.name}.{os.getpid()}")
    tmp.write_text(text)
    # What was written must read back as the lock it means: every pin of every closure, and
    # every wheel a file it allows.
    try:
        pins = wheels.read_lock(tmp)
        for platform in platforms:
            frozen, house = houses[platform.arch]
            wheels.check_frozen(frozen, pins, platform, tmp)
            wheels.check_wheels(house, pins, platform, tmp)
        os.replace(tmp, LOCK)
    finally:
        tmp.unlink(missing_ok=True)
    log(f"wrote {LOCK.relative_to(REPO)}: {len(pins)} pins, "
        f"{sum(len(p.hashes) for p in pins.values())} hashes")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failure as exc:
        log(str(exc))
        sys.exit(2)
    except KeyboardInterrupt:
        log("interrupted")
        sys.exit(130)
