"""The build cache: removing trees safely, temp dirs named for their build, finished
builds renamed into place, and pruning to the most recently used."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from buildenv import log
from recipe import PLATFORMS
from wheels import Failure

KEEP = 4  # cached requests kept (the most recently used), and their images


def remove_tree(path: Path) -> None:
    """rm -rf, refusing a tree something is still mounted under."""
    if not path.exists():
        return
    prefix = str(path.resolve()) + "/"
    with open("/proc/self/mounts") as mounts:
        held = [m.split()[1] for m in mounts if m.split()[1].startswith(prefix)]
    if held:
        raise Failure(f"{path} still has mounts ({', '.join(held)}); unmount them and remove it")
    shutil.rmtree(path)


def _by_use(paths) -> list[Path]:
    return sorted(paths, key=lambda d: d.stat().st_mtime, reverse=True)


def prune(root: Path, keep: set[Path]) -> None:
    """The KEEP most recently used requests, images and wheelhouses of each architecture,
    and the temp dirs of builds that died (their pid is gone)."""
    groups = [list((root / "out").glob("[!.]*"))]
    groups += [list((root / "parts").glob(f"{kind}-*")) for kind in
               {p.name.rsplit("-", 1)[0] for p in (root / "parts").glob("[!.]*")}]
    groups += [list((root / "wheelhouses").glob(f"{arch}-*")) for arch in PLATFORMS]
    for group in groups:
        for old in _by_use(d for d in group if d not in keep)[KEEP - 1:]:
            shutil.rmtree(old, ignore_errors=True)
    for tmp in [*root.glob("*/.tmp-*"), *root.glob(".tmp-*")]:
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            try:
                remove_tree(tmp)
            except (Failure, OSError) as exc:
                log(f"left {tmp}: {exc}")


def work_dir(parent: Path, name: str) -> Path:
    # The pid ends the name, for prune() to tell a dead build's leftovers.
    work = parent / f".tmp-{name}-{os.getpid()}"
    remove_tree(work)
    work.mkdir(parents=True)
    return work


def put_in_place(built: Path, dest: Path, scratch: Path) -> None:
    """Renames a finished build to its cache path (an older one there goes only now)."""
    if dest.exists():
        dest.rename(scratch / "old")
    try:
        built.rename(dest)
    except OSError:  # another build of the same key got there first
        if not dest.is_dir():
            raise
