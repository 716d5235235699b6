"""The host directories a reconcile writes: each checked before the first write, and what a
write that fails after the checks leaves behind.

Checked: the directory is a directory (or can be made under one), and can be written (not
read-only, not immutable, ours to write). Room for the artifacts is checked with their sizes
from the manifests (``kata_checks.preflight``). A write can still fail later (a remount, a disk
filling up meanwhile): the step's own roll-back undoes what it started (a group of GPUs goes
back to its driver), and ``kept`` says what is still in place, for the report that names the
``katamgr revert`` that undoes it.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from gpunode.host import vfio
from gpunode.host.root import STATE_DIR, HostRoot
from gpunode.policy import readiness
from katamgr.pipeline.cdi_specs import SPEC_DIR, spec_path, written_kinds


def written(*, vfio_step: bool, cdi: bool, readiness_files: bool, kata_dirs: tuple[str, ...] = ()
            ) -> dict[str, str]:
    """The directories the steps write, host path -> what for."""
    out = {STATE_DIR: "katamgr's records and the node lock"}
    if vfio_step and readiness_files:
        out[readiness.VALIDATIONS] = "the readiness files"
    if cdi:
        out[SPEC_DIR] = "the CDI specs"
    for directory in kata_dirs:
        out.setdefault(directory, "the Kata artifacts")
    return out


def problems(host: HostRoot, directories: dict[str, str]) -> list[str]:
    """One sentence per directory that cannot take its writes, naming it (nothing is written)."""
    out = []
    for directory, what in directories.items():
        local = host.path(directory)
        target = local
        while not target.exists() and not target.is_symlink() and target != target.parent:
            target = target.parent
        if target.is_symlink() and not target.exists():
            out.append(f"{host.host_path(target)} is a dangling symbolic link, so {directory} ({what}) "
                       "cannot be made; remove it or point it at a directory")
            continue
        if not target.is_dir():
            out.append(f"{host.host_path(target)} is not a directory, so {directory} ({what}) cannot be "
                       "written there; move it aside")
            continue
        if _read_only(target):
            out.append(f"{host.host_path(target)} cannot be written (read-only, immutable or not ours), "
                       f"so {what} cannot be written to {directory}; make it writable for katamgr")
    return out


def _read_only(path: Path) -> bool:
    if not os.access(path, os.W_OK | os.X_OK):
        return True
    # root passes access() on a read-only mount's files in some kernels' answers; the mount says so.
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return True


def failed_write(host: HostRoot, exc: OSError, doing: str) -> str:
    """One sentence for a write that failed after the checks, naming the path and the cause."""
    name = exc.filename
    if isinstance(name, (str, Path)) and str(name).startswith(str(host.root)) and not host.is_real_root:
        name = host.host_path(Path(name))
    fix = {errno.ENOSPC: "free space on the filesystem holding it (df shows which), then run the command again",
           errno.EDQUOT: "raise the quota or free space on the filesystem holding it, then run the command again",
           errno.EROFS: "that filesystem is mounted read-only: make it writable (or give katamgr another path), "
                        "then run the command again",
           errno.EACCES: "katamgr runs without the right to write there: run it as root",
           }.get(exc.errno or 0)
    return (f"{doing} stopped: a write failed ({name or 'a host file'}: {exc.strerror or exc})"
            + (f"; {fix}" if fix else ""))


def kept(host: HostRoot, kata_dirs: tuple[str, ...] = ()) -> list[str]:
    """What katamgr's changes still in place on the node are, from its records and files."""
    out = []
    bound = sorted(vfio.bound_by_us(host))
    if bound:
        out.append(f"kept: {', '.join(bound)} on vfio-pci (recorded by katamgr)")
    for path in (readiness.VFIO_READY, readiness.WORKLOAD_TYPE):
        if host.path(path).exists():
            out.append(f"kept: {path}")
    specs = [spec_path(kind) for kind in written_kinds(host) if host.path(spec_path(kind)).exists()]
    if specs:
        out.append(f"kept: the CDI specs {', '.join(specs)}")
    containerd = host.state_path("containerd")
    if containerd.is_dir() and any(p.suffix == ".json" for p in containerd.iterdir()):
        out.append("kept: katamgr's edit of containerd's config (recorded)")
    for directory in kata_dirs:
        if host.path(directory).is_dir() and any(host.path(directory).iterdir()):
            out.append(f"kept: Kata artifacts in {directory}")
    return out
