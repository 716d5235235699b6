"""The real-kernel suite's kernel: Debian's stock kernel package, fetched with ``apt-get
download`` into a cache outside the repository, unpacked with ``dpkg-deb -x`` (never
installed on the host) and indexed with ``depmod -b`` (``fetch_kernel``); the modules a
guest loads, with their dependencies (``module_chain``); and the errors and tool lookup
the test bed shares (``support.kernelvm`` boots it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# Where kernels are cached between runs: outside the repository, so a fresh clone
# (what CI tests) reuses it, and never committed. Override with this variable.
CACHE_ENV = "KATAMGR_KERNEL_CACHE"
META_PACKAGE = "linux-image-amd64"

class KernelVmError(Exception):
    """The real-kernel test bed could not be set up (a missing tool, a failed fetch)."""


def which(tool: str) -> str | None:
    """A tool's path; depmod and modprobe live in sbin, which a user's PATH may lack."""
    found = shutil.which(tool)
    if found:
        return found
    for directory in ("/usr/sbin", "/sbin", "/usr/bin"):
        candidate = Path(directory) / tool
        if candidate.exists():
            return str(candidate)
    return None


def _run(argv: Sequence[str], *, timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess:
    argv = [which(argv[0]) or argv[0], *argv[1:]]
    try:
        result = subprocess.run(  # noqa: S603 - argv lists we build, no shell
            list(argv), cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
        )
    except FileNotFoundError as exc:
        raise KernelVmError(f"{argv[0]} is not installed (run: bash .ci/setup)") from exc
    except subprocess.TimeoutExpired as exc:
        raise KernelVmError(f"{' '.join(argv)} took longer than {timeout:g} s") from exc
    if result.returncode != 0:
        raise KernelVmError(
            f"{' '.join(argv)} failed (exit {result.returncode}): {(result.stderr or result.stdout).strip()[-2000:]}"
        )
    return result


# ---- the kernel ----------------------------------------------------------------


@dataclass(frozen=True)
class KernelTree:
    """An unpacked kernel package: ``boot/vmlinuz-<release>`` and ``lib/modules/<release>``."""

    package: str  # linux-image-6.1.0-56-amd64
    release: str  # 6.1.0-56-amd64, what `uname -r` says in the guest
    root: Path

    @property
    def vmlinuz(self) -> Path:
        return self.root / "boot" / f"vmlinuz-{self.release}"

    @property
    def modules(self) -> Path:
        return self.root / "lib" / "modules" / self.release


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kata-sandbox-manager" / "kernel"


def stock_kernel_package() -> str:
    """The versioned image package ``linux-image-amd64`` points at in the apt cache
    (``apt-cache depends`` reads the local package lists; nothing is downloaded)."""
    result = _run(["apt-cache", "depends", META_PACKAGE], timeout=60)
    for line in result.stdout.splitlines():
        match = re.match(r"^\s*Depends:\s*(linux-image-\S+)$", line)
        if match and not match.group(1).endswith(("-dbg", "-unsigned")):
            return match.group(1)
    raise KernelVmError(
        f"apt-cache depends {META_PACKAGE} names no kernel image package; run apt-get update "
        f"(it said: {result.stdout.strip()[:500]})"
    )


def fetch_kernel(cache: Path | None = None) -> KernelTree:
    """The stock kernel, downloaded and unpacked once into ``cache`` (default
    ``cache_dir()``), shared between concurrent runs through a lock file."""
    cache = cache or cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / ".lock"):
        try:
            package = stock_kernel_package()
        except KernelVmError:
            # No apt lists (an offline machine): any kernel unpacked earlier will do.
            cached = sorted(p for p in cache.glob("linux-image-*") if (p / ".complete").exists())
            if not cached:
                raise
            package = cached[-1].name
        tree_dir = cache / package
        if not (tree_dir / ".complete").exists():
            _unpack(cache, package, tree_dir)
        releases = sorted(p.name for p in (tree_dir / "lib" / "modules").iterdir())
        if len(releases) != 1:
            raise KernelVmError(f"{tree_dir} holds {len(releases)} module trees, expected one")
        return KernelTree(package, releases[0], tree_dir)


def _unpack(cache: Path, package: str, tree_dir: Path) -> None:
    downloads = cache / "debs"
    downloads.mkdir(exist_ok=True)
    debs = sorted(downloads.glob(f"{package}_*.deb"))
    if not debs:
        _run(["apt-get", "download", "-q", package], cwd=downloads, timeout=600)
        debs = sorted(downloads.glob(f"{package}_*.deb"))
        if not debs:
            raise KernelVmError(f"apt-get download {package} left no .deb in {downloads}")
    # Unpacked beside the final place and renamed into it: a killed run leaves no
    # half tree behind the ".complete" marker.
    staging = Path(tempfile.mkdtemp(prefix=f".{package}.", dir=cache))
    try:
        _run(["dpkg-deb", "-x", str(debs[-1]), str(staging)], timeout=300)
        releases = [p.name for p in (staging / "lib" / "modules").iterdir()]
        for release in releases:
            # modules.dep and friends are made by the package's postinst, which
            # unpacking does not run.
            _run(["depmod", "-b", str(staging), release], timeout=300)
        (staging / ".complete").write_text(debs[-1].name + "\n")
        if tree_dir.exists():
            shutil.rmtree(tree_dir)
        staging.rename(tree_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def module_chain(tree: KernelTree, names: Sequence[str]) -> list[Path]:
    """The .ko files to insmod, dependencies first, for ``names`` (modprobe's own order)."""
    chain: list[Path] = []
    for name in names:
        result = _run(["modprobe", "-d", str(tree.root), "-S", tree.release, "--show-depends", name], timeout=30)
        for line in result.stdout.splitlines():
            parts = line.split()
            if parts[:1] == ["insmod"]:
                path = Path(parts[1])
                if path not in chain:
                    chain.append(path)
            # "builtin NAME" lines need nothing loaded.
    return chain
