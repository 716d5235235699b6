"""The image's Python dependencies: which versions (.venv's), and their wheels for one
architecture (hack/image/build).

The versions are the ones the tests ran: the runtime closure of pyproject's dependencies
as installed in .venv, with markers evaluated as the image's Python would. The wheels are
fetched for the image's Python (recipe.PYTHON), glibc (recipe.GLIBC) and architecture, never
for the building machine's, so an amd64 machine fetches an arm64 image's wheels the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from recipe import PYTHON, Platform


class Failure(Exception):
    """A build that cannot go on: exit 2 with this message."""


# Requirements pinned by hash (pip's --require-hashes format), as .ci/setup installs them:
# the image takes exactly those files too.
PINNED = Path(__file__).resolve().parents[2] / "requirements"


def pinned_hashes() -> dict[str, set[str]]:
    """``name==version`` (the name canonical) -> the sha256 digests its pin allows."""
    _, canonicalize_name = _packaging()
    pins: dict[str, set[str]] = {}
    for path in sorted(PINNED.glob("*.txt")):
        text = path.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            words = line.split("#", 1)[0].split()
            if not words or "==" not in words[0]:
                continue
            name, version = words[0].split("==", 1)
            pins[f"{canonicalize_name(name)}=={version}"] = {
                w.split(":", 1)[1] for w in words[1:] if w.startswith("--hash=sha256:")}
    return pins


def check_pinned(house: Path) -> None:
    """Every wheel whose requirement is pinned by hash is one of the files its pin allows."""
    _, canonicalize_name = _packaging()
    pins = pinned_hashes()
    for wheel in house.glob("*.whl"):
        name, version = wheel.name.split("-")[:2]
        allowed = pins.get(f"{canonicalize_name(name)}=={version}")
        if allowed is None:
            continue
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest not in allowed:
            raise Failure(f"{wheel.name} has sha256 {digest}, which its pin in {PINNED} does not "
                          f"allow ({', '.join(sorted(allowed))}); the index served another file")


def _packaging():
    try:
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.utils import canonicalize_name
    return Requirement, canonicalize_name


def site_packages() -> Path:
    import sysconfig

    return Path(sysconfig.get_paths()["purelib"])


def pip_version() -> str:
    found = [p for p in os.listdir(site_packages()) if p.startswith("pip-") and p.endswith(".dist-info")]
    if len(found) != 1:
        raise Failure(f"no single pip in .venv ({found}); run: bash .ci/setup")
    return found[0][len("pip-"):-len(".dist-info")]


def frozen_requirements(dependencies: list[str], platform: Platform, root: Path) -> list[str]:
    """`name==version` of every runtime dependency (``dependencies`` and theirs, markers
    evaluated for ``platform``, no test extras) as installed in .venv. Reading every
    distribution's metadata takes a while, so the list is kept in the cache by what decides
    it: the dependencies, the platform and the names of .venv's dist-info dirs (which carry
    the versions)."""
    listing = sorted(p for p in os.listdir(site_packages()) if p.endswith(".dist-info"))
    fingerprint = hashlib.sha256(json.dumps([dependencies, platform.arch, listing])
                                 .encode()).hexdigest()[:24]
    saved = root / "frozen" / f"{fingerprint}.json"
    if saved.is_file():
        return json.loads(saved.read_text())
    frozen = _closure(dependencies, platform)
    saved.parent.mkdir(parents=True, exist_ok=True)
    tmp = saved.with_name(f".{saved.name}.{os.getpid()}")
    tmp.write_text(json.dumps(frozen))
    os.replace(tmp, saved)
    return frozen


def _closure(dependencies: list[str], platform: Platform) -> list[str]:
    from importlib import metadata

    Requirement, canonical = _packaging()
    environment = platform.marker_environment()
    pins: dict[str, str] = {}
    done: set[tuple[str, frozenset]] = set()
    todo = [(Requirement(d), "kata-sandbox-manager") for d in dependencies]
    while todo:
        req, wanted_by = todo.pop()
        if req.marker and not req.marker.evaluate({**environment, "extra": ""}):
            continue
        name = canonical(req.name)
        if (name, frozenset(req.extras)) in done:
            continue
        done.add((name, frozenset(req.extras)))
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            raise Failure(f"{req.name} (wanted by {wanted_by} on {platform.name}) is not "
                          "installed in .venv; run: bash .ci/setup") from None
        if not req.specifier.contains(dist.version, prereleases=True):
            raise Failure(f".venv has {req.name} {dist.version}, but {wanted_by} wants {req}; "
                          "run: bash .ci/setup")
        pins[name] = dist.version
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker and not any(sub.marker.evaluate({**environment, "extra": e})
                                      for e in ("", *sorted(req.extras))):
                continue
            sub.marker = None
            todo.append((sub, name))
    return [f"{name}=={version}" for name, version in sorted(pins.items())]


def _pip(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return subprocess.run([sys.executable, "-m", "pip", *args], env=env,  # noqa: S603
                          capture_output=True, text=True)


def _tail(proc: subprocess.CompletedProcess) -> str:
    return "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])


def wheelhouse(frozen: list[str], pip: str, platform: Platform, root: Path, log) -> Path:
    """The dependencies' wheels for ``platform`` (and pip's, to install them with), cached
    by the frozen list and the platform. A project with no wheel for the platform is built
    here from its sdist, and taken only if that wheel is pure Python."""
    target = ["--python-version", "".join(map(str, PYTHON)), "--implementation", "cp",
              "--abi", "cp" + "".join(map(str, PYTHON)),
              *(arg for tag in platform.wheel_platforms() for arg in ("--platform", tag))]
    key = hashlib.sha256("\n".join([*frozen, f"pip=={pip}", *target]).encode()).hexdigest()[:24]
    house = root / "wheelhouses" / f"{platform.arch}-{key}"
    if house.is_dir():
        os.utime(house)  # most recently used, for prune()
        return house
    house.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=house.parent))
    try:
        log(f"fetching {len(frozen)} wheels for {platform.name} into the wheelhouse")
        no_wheel: dict[str, str] = {}  # pin -> what pip said
        requirements = tmp / "requirements.txt"
        requirements.write_text("\n".join(frozen) + "\n")
        download = ["download", "-q", "--no-deps", "--only-binary=:all:", *target, "--dest", str(tmp)]
        if _pip([*download, "-r", str(requirements)]).returncode:
            # One at a time, to learn which have no wheel for the platform.
            for pin in frozen:
                proc = _pip([*download, pin])
                if proc.returncode:
                    no_wheel[pin] = _tail(proc)
        for pin, said in no_wheel.items():
            built = tmp / "built"
            proc = _pip(["wheel", "-q", "--no-deps", "--no-binary=:all:", "--wheel-dir",
                         str(built), pin])
            wheels = list(built.glob("*.whl")) if built.is_dir() else []
            where = f"CPython {'.'.join(map(str, PYTHON))} on {platform.name} (glibc <= 2.36)"
            if proc.returncode or len(wheels) != 1:
                raise Failure(f"pip found no wheel of {pin} for {where}:\n{said}\n"
                              f"and its sdist did not build:\n{_tail(proc)}")
            if not wheels[0].name.endswith("-none-any.whl"):
                raise Failure(f"pip found no wheel of {pin} for {where}, and its sdist builds "
                              f"a platform wheel here ({wheels[0].name}): the image cannot take it")
            wheels[0].rename(tmp / wheels[0].name)
            shutil.rmtree(built)
        proc = _pip(["download", "-q", "--no-deps", "--only-binary=:all:", "--dest", str(tmp),
                     f"pip=={pip}"])
        if proc.returncode:
            raise Failure(f"pip download pip=={pip} failed:\n{_tail(proc)}")
        check_pinned(tmp)
        try:
            tmp.rename(house)
        except OSError:  # another build got there first
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return house
