"""The image's Python dependencies: which versions (.venv's), which files (the lock's), and
their wheels for one architecture (hack/image/build, hack/image/lock).

The versions are the ones the tests ran: the runtime closure of pyproject's dependencies
as installed in .venv, with markers evaluated as the image's Python would. The wheels are
fetched for the image's Python (recipe.PYTHON), glibc (recipe.GLIBC) and architecture, never
for the building machine's, so an amd64 machine fetches an arm64 image's wheels the same way.
Which files those must be is requirements/image.lock (LOCK): every wheel by its sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from recipe import PYTHON, Platform


class Failure(Exception):
    """A build that cannot go on: exit 2 with this message."""


# The image's lock: every wheel the image installs, by name, version and sha256 (pip's
# hash-checking requirements format). hack/image/lock writes it from .venv's versions and the
# wheels fetched for each architecture; the image installs exactly those files (recipe.HOOK:
# pip --require-hashes), .ci/setup installs .venv's runtime dependencies from it, and
# tests/image/test_lock.py keeps it equal to .venv. Pins reviewed by hand (requirements/*.txt:
# gpu-admin-tools) are not repeated there: the lock includes them (-r), one source each.
REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements"
LOCK = REQUIREMENTS / "image.lock"
REGENERATE = "hack/image/lock"
# The installer: run from its wheel in the build root, never installed in the image (recipe.HOOK).
INSTALLER = "pip"
# In a wheelhouse: the wheels built there from an sdist (the index had none for the platform).
BUILT_HERE = "built-from-sdist.txt"


@dataclass(frozen=True)
class Pin:
    """One requirement of the lock (or of a file it includes)."""

    name: str  # canonical
    version: str
    hashes: frozenset[str]  # sha256, hex
    marker: str | None  # PEP 508; None: every platform
    source: Path  # the file that pins it

    def applies(self, platform: Platform) -> bool:
        if self.marker is None:
            return True
        return _packaging_marker()(self.marker).evaluate(platform.marker_environment())


def read_lock(path: Path = LOCK) -> dict[str, Pin]:
    """Canonical name -> its pin, from ``path`` and the files it includes (``-r FILE``,
    relative to it). Every line must be ``name==version [; marker] --hash=sha256:...``: a
    requirement without a hash, or a looser one, would let pip choose a file."""
    Requirement, canonicalize_name = _packaging()
    if not path.is_file():
        raise Failure(f"{path} is missing; run: {REGENERATE}")
    pins: dict[str, Pin] = {}
    # A continued line is one line to pip; a comment runs from a '#' at a line's start or
    # after whitespace.
    text = path.read_text().replace("\\\n", " ")
    for number, line in enumerate(text.splitlines(), 1):
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if not line:
            continue
        where = f"{path}:{number}"
        words = line.split()
        if words[0] in ("-r", "--requirement"):
            if len(words) != 2:
                raise Failure(f"{where}: {line!r}: -r takes one file")
            for name, pin in read_lock(path.parent / words[1]).items():
                if name in pins:
                    raise Failure(f"{where}: {name} is pinned twice ({pins[name].source} and "
                                  f"{pin.source})")
                pins[name] = pin
            continue
        cut = line.find("--hash=")
        spec, options = (line, "") if cut < 0 else (line[:cut], line[cut:])
        hashes = set()
        for option in options.split():
            algorithm, _, digest = option.removeprefix("--hash=").partition(":")
            if not option.startswith("--hash=") or algorithm != "sha256" or not re.fullmatch(
                    r"[0-9a-f]{64}", digest):
                raise Failure(f"{where}: {option!r}: only --hash=sha256:<64 hex> is taken")
            hashes.add(digest)
        try:
            req = Requirement(spec.strip())
        except Exception as exc:  # packaging's InvalidRequirement, vendored or not
            raise Failure(f"{where}: {spec.strip()!r}: {exc}") from None
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version or req.url:
            raise Failure(f"{where}: {req} is not pinned to one version (name==version)")
        if not hashes:
            raise Failure(f"{where}: {req} has no --hash=sha256: pip would take any file")
        name = canonicalize_name(req.name)
        if name in pins:
            raise Failure(f"{where}: {name} is pinned twice ({pins[name].source} too)")
        pins[name] = Pin(name, specs[0].version, frozenset(hashes),
                         str(req.marker) if req.marker else None, path)
    return pins


def lock_sources(pins: dict[str, Pin], path: Path = LOCK) -> list[Path]:
    """The lock and the files it includes, for copying beside it into the build root."""
    return sorted({path, *(pin.source for pin in pins.values())})


def check_frozen(frozen: list[str], pins: dict[str, Pin], platform: Platform,
                 path: Path = LOCK) -> None:
    """The lock pins, for ``platform``, exactly .venv's runtime closure (``frozen``)."""
    locked = {f"{p.name}=={p.version}" for p in pins.values() if p.applies(platform)}
    if locked != set(frozen):
        raise Failure(f"{path} differs from .venv's runtime dependencies for {platform.name}:\n"
                      f"  only in .venv: {sorted(set(frozen) - locked)}\n"
                      f"  only in the lock: {sorted(locked - set(frozen))}\n"
                      f"run: {REGENERATE} (it hashes .venv's versions' wheels), and review its diff")


def wheel_pin(wheel: Path) -> tuple[str, str]:
    """(canonical name, version) from a wheel's file name (PEP 427)."""
    _, canonicalize_name = _packaging()
    name, version = wheel.name.split("-")[:2]
    return canonicalize_name(name), version


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_wheels(house: Path, pins: dict[str, Pin], platform: Platform,
                 path: Path = LOCK) -> None:
    """Every wheel in ``house`` but the installer's is a file the lock allows, by name,
    version and sha256, and every pin for ``platform`` has its wheel there: the image takes
    no file the lock does not name."""
    seen = set()
    for wheel in sorted(house.glob("*.whl")):
        name, version = wheel_pin(wheel)
        if name == INSTALLER:
            continue
        pin = pins.get(name)
        if pin is None or pin.version != version or not pin.applies(platform):
            locked = (f"pins {name} {pin.version}" if pin and pin.version != version
                      else f"does not pin {name} for {platform.name}" if pin
                      else f"does not pin {name} at all")
            raise Failure(f"{wheel.name} ({house}) is not in the lock: {path} {locked}; "
                          f"run: {REGENERATE}")
        digest = sha256_file(wheel)
        if digest not in pin.hashes:
            raise Failure(f"refusing {wheel.name}: its sha256 is {digest}, but {pin.source} "
                          f"allows {name}=={version} only as sha256 "
                          f"{', '.join(sorted(pin.hashes))}. The index served another file than "
                          f"the one locked; if the lock is right, remove {house} to fetch again")
        seen.add(name)
    missing = sorted(f"{p.name}=={p.version}" for p in pins.values()
                     if p.applies(platform) and p.name not in seen)
    if missing:
        raise Failure(f"the {platform.name} wheelhouse {house} has no wheel of {', '.join(missing)}, "
                      f"which {path} pins")


def _packaging():
    try:
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.utils import canonicalize_name
    return Requirement, canonicalize_name


def _packaging_marker():
    try:
        from packaging.markers import Marker
    except ImportError:
        from pip._vendor.packaging.markers import Marker
    return Marker


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
    frozen = runtime_closure(dependencies, platform)
    saved.parent.mkdir(parents=True, exist_ok=True)
    tmp = saved.with_name(f".{saved.name}.{os.getpid()}")
    tmp.write_text(json.dumps(frozen))
    os.replace(tmp, saved)
    return frozen


def runtime_closure(dependencies: list[str], platform: Platform) -> list[str]:
    """`name==version` of every distribution ``dependencies`` reach in .venv (see
    frozen_requirements, which caches it)."""
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


def wheelhouse(frozen: list[str], pip: str, platform: Platform, root: Path, log,
               check: Callable[[Path], None] | None = None) -> Path:
    """The dependencies' wheels for ``platform`` (and pip's, to install them with), cached
    by the frozen list and the platform. A project with no wheel for the platform is built
    here from its sdist, and taken only if that wheel is pure Python (its hash then is this
    build's: the lock takes it only as hack/image/lock saw it). ``check`` is called on a
    fetched wheelhouse before it is cached (check_wheels: a download the lock refuses is not
    kept); a cached one is returned as it is, for the caller to check."""
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
            # Recorded for hack/image/lock: a wheel built here has this machine's hash, not
            # a file anyone else can fetch and check.
            with open(tmp / BUILT_HERE, "a") as listed:
                listed.write(wheels[0].name + "\n")
        proc = _pip(["download", "-q", "--no-deps", "--only-binary=:all:", "--dest", str(tmp),
                     f"pip=={pip}"])
        if proc.returncode:
            raise Failure(f"pip download pip=={pip} failed:\n{_tail(proc)}")
        if check is not None:
            check(tmp)
        try:
            tmp.rename(house)
        except OSError:  # another build got there first
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return house
