"""The Kata step's checks before the node's first write, one runtime class at a time.

A runtime class whose artifact cannot be had now (its registry unreachable, a manifest that
is not a Kata artifact, a pull secret that cannot be read, kata-deploy not providing it) is
that class's failure, named, and the rest of the node goes ahead: the GPUs are bound, the CDI
specs written, every other class installed and registered (``Preflight.failed``; the class is
then not offered on the node, ``pipeline.offers``). What is wrong for the whole node stops
everything before any write: a containerd config that does not parse or cannot be written, an
artifacts dir that is not ours (ConfigError, exit 2), too little room for the artifacts
(GpuNodeError, exit 1).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from gpunode.errors import ConfigError, GpuNodeError
from gpunode.host.root import HostRoot
from katamgr.artifacts import (
    ArtifactError,
    NotOursError,
    read_install,
    resolve_artifact,
)
from katamgr.pipeline.kata_checked import Checked, Preflight
from katamgr.pipeline.kata_runtime import (
    KataContext,
    class_dir,
    kata_deploy_missing,
    kata_deploy_runtime,
    not_ours,
    pull_of,
    runtimes,
)
from katamgr.runtime import configure_containerd


def class_problems(host: HostRoot, ctx: KataContext) -> dict[str, str]:
    """Each runtime class that would fail on this node now, and why (plan's manifest check:
    every source is asked for its manifest, nothing is written)."""
    out: dict[str, str] = {}
    for rc in ctx.config.runtime_classes:
        if kata_deploy_runtime(ctx, rc.name) is not None:
            continue
        missing = kata_deploy_missing(ctx, rc.name)
        if missing:
            out[rc.name] = missing
            continue
        try:
            found = resolve_artifact(pull_of(host, ctx, rc), host.path(class_dir(ctx.config, rc.name)))
        except NotOursError as exc:
            out[rc.name] = not_ours(rc, ctx.config, exc)
        except (ArtifactError, GpuNodeError) as exc:  # ConfigError included: a pull secret unread
            out[rc.name] = f"runtime class {rc.name}: {exc}"
        else:
            if found.warning:  # the source is down but an install is kept: works, say so
                continue
    return out


def preflight(host: HostRoot, ctx: KataContext, *, enable_cdi: bool = True) -> Preflight:
    """Check everything this step needs before the node's first write.

    Raises ConfigError (exit 2) listing every bad input of the node, or GpuNodeError (exit 1)
    when the inputs are fine but the node cannot take the change now (no room); either way
    nothing was changed yet. A runtime class that cannot be installed now is in
    ``Preflight.failed``, not raised: the rest of the node goes ahead without it.
    """
    config = ctx.config
    bad: list[str] = []
    blocked: list[str] = []
    try:
        configure_containerd(host, runtimes(host, ctx), config.containerd.config_path,
                             config.containerd.version, enable_cdi=enable_cdi, dry_run=True)
    except GpuNodeError as exc:
        bad.append(str(exc))
    bad += _not_writable(host, config.containerd.config_path)
    needed: dict[Path, int] = {}
    found = Preflight()
    for rc in config.runtime_classes:
        if kata_deploy_runtime(ctx, rc.name) is not None:
            continue  # kata-deploy's: nothing to pull
        missing = kata_deploy_missing(ctx, rc.name)
        if missing:
            found.failed[rc.name] = missing
            continue
        dest = host.path(class_dir(config, rc.name))
        if ctx.retry_classes is not None and rc.name not in ctx.retry_classes and read_install(dest) is not None:
            found.kept.add(rc.name)  # a retry of the failed classes: this one is in place
            continue
        try:
            pull = pull_of(host, ctx, rc)
            resolution = resolve_artifact(pull, dest)
        except NotOursError as exc:  # someone else's files where ours would go: stop, touch nothing
            bad.append(not_ours(rc, config, exc))
        except (ArtifactError, GpuNodeError) as exc:
            # This class's own source: unreachable, a bad manifest, its pull secret missing or
            # unreadable (ConfigError included): that class fails, the rest goes ahead.
            found.failed[rc.name] = f"runtime class {rc.name}: {exc}"
        else:
            found.checked[rc.name] = Checked(pull, resolution)
            if resolution.bytes_needed:
                volume = existing(dest.parent)
                needed[volume] = needed.get(volume, 0) + resolution.bytes_needed
    for volume, size in needed.items():
        free = shutil.disk_usage(volume).free
        if size > free:
            blocked.append(f"{host.host_path(volume)} has {free} bytes free, the artifacts need {size}; "
                           "free some space or choose another kataManager.config.artifactsDir")
    if bad:
        raise ConfigError("nothing was changed: " + "; ".join(bad + blocked))
    if blocked:
        raise GpuNodeError("nothing was changed: " + "; ".join(blocked))
    return found


def _not_writable(host: HostRoot, config_path: str) -> list[str]:
    local = host.path(config_path)
    target = Path(os.path.realpath(local)) if local.is_symlink() else local
    if target.exists():
        if not os.access(target, os.W_OK):
            return [f"{host.host_path(target)} cannot be written (read-only, immutable or not ours to "
                    "write); make it writable for katamgr or turn kataManager off on this node"]
        parent = target.parent
    else:
        parent = existing(target.parent)
    if not os.access(parent, os.W_OK):
        return [f"{host.host_path(parent)} cannot be written, so containerd's config beside it cannot be "
                "replaced atomically; make it writable for katamgr"]
    return []


def existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
