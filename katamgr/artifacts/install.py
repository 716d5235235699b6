"""Install an artifact into its runtime class dir, atomically and only when it changed.

The files are downloaded into a staging dir beside the destination (same filesystem),
each verified as it streams (``verified``), then the staging dir replaces the destination
whole (``swap``). The install's record (``record``) makes a run whose source offers the
recorded digest transfer nothing, and keeps katamgr off dirs it did not install.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpunode.host.faults import write_point
from gpunode.host.files import fsync_dir, write_atomic

from .errors import ArtifactError
from .manifest import Layer, Manifest, parse_manifest
from .pull import Pull
from .record import (
    RECORD_NAME,
    InstalledFile,
    InstallRecord,
    check_ours,
    intact_files,
    read_install,
)
from .refs import ArtifactRef
from .source import FetchedManifest, RetryPolicy, Source, SourceUnreachable, with_retries
from .swap import leftovers, lock_path, locked, recover, swap
from .verified import Stopped, write_verified

log = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024  # read size for reused local files (sources pick their own)
LAYER_THREADS = 3  # layers fetched at once; more only contend for 2 cores and the disk


@dataclass
class InstallResult:
    name: str  # the runtime class dir's name
    dest: Path
    ref: str
    digest: str  # the installed manifest digest
    changed: bool  # the dir was replaced this run
    files: list[str] = field(default_factory=list)
    bytes_transferred: int = 0  # blob bytes read from the source (manifests not counted)
    warning: str | None = None  # set when the source was unreachable and the old install kept


@dataclass(frozen=True)
class Resolution:
    """What installing an artifact would take, found before anything is written."""

    digest: str | None  # the manifest digest the source offers (None: kept install, source down)
    bytes_needed: int  # free space the install needs beside the destination (0: up to date)
    warning: str | None = None  # the source is unreachable but a complete install is kept
    fetched: FetchedManifest | None = None  # for install_artifact: what was checked is installed


def resolve_artifact(pull: Pull | str | ArtifactRef, dest: Path, **how: Any) -> Resolution:
    """Check that ``pull`` can be installed into ``dest``: the destination is ours, the
    source answers with a valid manifest, and there is room. Writes nothing; raises
    what ``install_artifact`` would (NotOursError, ArtifactError, SourceUnreachable).
    ``how``: ``Pull.of``'s options, when ``pull`` is a reference.
    """
    pull = Pull.of(pull, **how)
    dest = Path(dest)
    check_ours(dest)
    source = pull.source()
    current = read_install(dest) if dest.is_dir() else None
    try:
        fetched = with_retries(pull.retry, source.fetch_manifest)
    except SourceUnreachable as exc:
        if current is None:
            raise
        return Resolution(None, 0, f"{exc}; the installed {current.ref} ({current.digest}) is kept")
    manifest = _manifest(pull, fetched)
    if current is not None and current.digest == manifest.digest:
        return Resolution(manifest.digest, 0, fetched=fetched)
    # The new files are staged beside the old install before the swap.
    return Resolution(manifest.digest, manifest.total_size, fetched=fetched)


def install_artifact(
    pull: Pull | str | ArtifactRef,
    dest: Path,
    *,
    verify_files: bool = False,
    fetched: FetchedManifest | None = None,
    check: Callable[[Path, Manifest], None] | None = None,
    **how: Any,
) -> InstallResult:
    """Make ``dest`` hold exactly the files of the artifact; see the module doc.

    ``fetched`` is the manifest ``resolve_artifact`` already read (not fetched again,
    so what was checked is what gets installed). ``check(staging, manifest)`` runs on the
    complete staged files before the swap: its ArtifactError refuses them, nothing changed
    (the guest images' dm-verity root hashes); where it has them, ``check.tap(layer, path)`` gives
    what sees a download's bytes as they stream and ``check.layer_done(name)`` hears of each
    file complete (layers are then fetched smallest first). ``verify_files`` re-hashes installed
    files even when their size and mtime match the record. ``how``: ``Pull.of``'s options,
    when ``pull`` is a reference. Raises ArtifactError (the previous install untouched) or
    ConfigError (bad reference).
    """
    pull = Pull.of(pull, **how)
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    source = pull.source()
    check_ours(dest)  # before the lock file is created: a refusal writes nothing
    with locked(dest):
        recover(dest)
        check_ours(dest)
        current = read_install(dest) if dest.is_dir() else None
        intact = intact_files(dest, current, verify_files) if current else {}
        complete = current is not None and len(intact) == len(current.files)
        try:
            if fetched is None:
                fetched = with_retries(pull.retry, source.fetch_manifest)
        except SourceUnreachable as exc:
            if current is None or not complete:
                raise
            warning = f"{exc}; kept the installed {current.ref} ({current.digest}) in {dest}"
            log.warning("%s", warning)
            return InstallResult(dest.name, dest, current.ref, current.digest, False,
                                 [f.name for f in current.files], 0, warning)
        manifest = _manifest(pull, fetched)
        if complete and current is not None and current.digest == manifest.digest:
            if current.ref != pull.label:
                write_atomic(dest / RECORD_NAME, InstallRecord(pull.label, current.digest, current.files).text())
            log.debug("%s: %s already holds %s, nothing to do", pull.label, dest, manifest.digest)
            return InstallResult(dest.name, dest, pull.label, manifest.digest, False,
                                 [layer.name for layer in manifest.layers], 0)
        transferred = _stage_and_swap(source, manifest, pull.label, dest, intact, pull.retry, check)
        return InstallResult(dest.name, dest, pull.label, manifest.digest, True,
                             [layer.name for layer in manifest.layers], transferred)


def remove_install(dest: Path) -> bool:
    """Remove an install of ours and whatever a killed run left beside it; True when
    an install was removed. A dir that is not ours is never touched.

    The dir is first renamed aside in one step, so a crash part-way through the
    deletion leaves no half-removed install under the runtime class's name: the
    next run (install or removal) deletes the renamed leftovers.
    """
    dest = Path(dest)
    lock = lock_path(dest)
    if not (lock.exists() or leftovers(dest) or read_install(dest) is not None):
        return False  # nothing of ours here: not even a lock file is created
    removed = False
    with locked(dest):
        recover(dest)
        if not dest.is_symlink() and read_install(dest) is not None:
            trash = dest.parent / f".{dest.name}.removing-{os.getpid()}-{time.monotonic_ns()}"
            write_point(f"rename {dest} aside")
            os.rename(dest, trash)
            fsync_dir(dest.parent)
            write_point(f"delete {trash}")
            shutil.rmtree(trash)
            removed = True
        write_point(f"remove the lock of {dest}")
        lock.unlink(missing_ok=True)
    fsync_dir(dest.parent)
    return removed


def _manifest(pull: Pull, fetched: FetchedManifest) -> Manifest:
    return parse_manifest(fetched.data, pull.label, expected_digest=fetched.expected_digest,
                          max_layer_bytes=pull.max_layer_bytes, media_type=fetched.media_type)


def _stage_and_swap(
    source: Source, manifest: Manifest, ref: str, dest: Path, intact: dict[str, Path],
    policy: RetryPolicy, check: Callable[[Path, Manifest], None] | None = None,
) -> int:
    write_point(f"stage {dest}")
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.staging-", dir=dest.parent))
    try:
        files, transferred = _fill(source, manifest, ref, staging, intact, policy, check)
        if check is not None:
            check(staging, manifest)
        record = InstallRecord(ref, manifest.digest, tuple(files))
        with (staging / RECORD_NAME).open("w") as out:
            out.write(record.text())
            out.flush()
            os.fsync(out.fileno())  # after a crash the swapped-in dir must hold its record
        os.chmod(staging, 0o755)
        fsync_dir(staging)
        write_point(f"swap {staging} into {dest}")
        swap(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("%s: installed %s into %s (%d files, %d bytes downloaded)", ref, manifest.digest,
             dest, len(files), transferred)
    return transferred


def _fill(
    source: Source, manifest: Manifest, ref: str, staging: Path, intact: dict[str, Path],
    policy: RetryPolicy, check: Any = None,
) -> tuple[list[InstalledFile], int]:
    """Put every layer's file, verified and fsynced, into ``staging``; bytes downloaded."""
    stop = threading.Event()  # set when one layer failed: the others give up at their next chunk

    def fill_one(layer: Layer) -> tuple[InstalledFile, int]:
        target = staging / layer.name
        local = intact.get(layer.digest)
        transferred = 0
        if not (local and _copy_local(local, target, layer, ref, stop)):
            transferred = with_retries(policy, lambda: _download(source, layer, target, ref, stop, check))
        entry = InstalledFile(layer.name, layer.digest, layer.size, target.stat().st_mtime_ns)
        if hasattr(check, "layer_done"):
            check.layer_done(layer.name)
        return entry, transferred

    # layers download side by side: one blob's fsync and hashing overlap another's transfer
    with ThreadPoolExecutor(min(LAYER_THREADS, len(manifest.layers)) or 1,
                            thread_name_prefix="artifact-layer") as pool:
        # for a check that looks at streams, the small files first: a Kata config is written
        # before the images it describes stream
        order = sorted(manifest.layers, key=lambda x: x.size) if hasattr(check, "tap") else manifest.layers
        futures = [pool.submit(fill_one, layer) for layer in order]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
        except BaseException:  # a stop signal: the layer threads' reads are cut, not waited for
            stop.set()
            from katamgr.artifacts.remote import cut_transfers

            cut_transfers()
            raise
        finally:
            stop.set()  # a no-op once all are done; stops the rest after a failure or interrupt
            pool.shutdown(wait=True, cancel_futures=True)
        failures = [f.exception() for f in futures if not f.cancelled() and f.exception()]
        if failures:  # the cause, not a layer that stopped because of it
            raise next((e for e in failures if not isinstance(e, Stopped)), failures[0])
        done = {entry.name: (entry, count) for entry, count in (future.result() for future in futures)}
        results = [done[layer.name] for layer in manifest.layers]
    return [entry for entry, _ in results], sum(count for _, count in results)


def _download(source: Source, layer: Layer, target: Path, ref: str, stop: threading.Event,
              check: Any = None) -> int:
    if stop.is_set():  # a retry after the others stopped (or a stop signal cut this one)
        raise Stopped(f"{ref}: stopped {layer.name} before its download")
    # a check may look at the bytes as they stream (each attempt afresh): the work overlaps the transfer
    tap = check.tap(layer, target) if hasattr(check, "tap") else None
    with source.open_blob(layer) as chunks:
        write_verified(chunks, target, layer, ref, stop, progress=True, tap=tap)
    return layer.size


def _copy_local(local: Path, target: Path, layer: Layer, ref: str, stop: threading.Event) -> bool:
    """Reuse an installed file with the same digest; False when it turns out damaged."""
    try:
        with local.open("rb") as handle:
            write_verified(iter(lambda: handle.read(CHUNK_BYTES), b""), target, layer, ref, stop)
    except Stopped:
        raise
    except (ArtifactError, OSError) as exc:
        log.info("%s: cannot reuse %s (%s); downloading it", ref, local, exc)
        return False
    return True
