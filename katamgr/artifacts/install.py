"""Install an artifact into its runtime class dir, atomically and only when it changed.

The files are downloaded into a staging dir beside the destination (same filesystem),
each verified against the manifest's sha256 digest and size while it streams, then the
staging dir replaces the destination in one rename (``renameat2(RENAME_EXCHANGE)``;
where the filesystem lacks it, two renames, and an interrupted swap is finished by the
next run). ``.katamgr-artifact.json`` in the dir records the ref, manifest digest and
files, so a run whose remote digest equals the recorded one transfers nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from katamgr.host.faults import write_point
from katamgr.host.files import fsync_dir, write_atomic

from .credentials import Credentials
from .deadlines import DEFAULT_DEADLINES, Deadlines
from .errors import ArtifactError
from .layout import LayoutSource
from .manifest import DEFAULT_MAX_LAYER_BYTES, Layer, Manifest, parse_manifest
from .refs import ArtifactRef, LayoutRef, parse_ref
from .source import FetchedManifest, RetryPolicy, Source, SourceUnreachable, with_retries

log = logging.getLogger(__name__)

RECORD_NAME = ".katamgr-artifact.json"
PROGRESS_MIN_BYTES = 8 * 1024 * 1024
PROGRESS_EVERY_SECONDS = 2.0
CHUNK_BYTES = 1024 * 1024  # read size for reused local files (sources pick their own)
PIPELINE_MIN_BYTES = 4 * 1024 * 1024  # smaller blobs are hashed inline: a thread costs more
PIPELINE_DEPTH = 8  # chunks (of up to 1 MiB) received ahead of the hashing thread
WRITEBACK_BYTES = 8 * 1024 * 1024  # start writing each 8 MiB to disk as soon as it is written
LAYER_THREADS = 3  # layers fetched at once; more only contend for 2 cores and the disk
FILE_MODE = 0o644


@dataclass(frozen=True)
class InstalledFile:
    name: str
    digest: str
    size: int
    mtime_ns: int  # when it was written; an unchanged mtime spares re-hashing every run


@dataclass(frozen=True)
class InstallRecord:
    """What ``.katamgr-artifact.json`` says is installed in a runtime class dir."""

    ref: str
    digest: str
    files: tuple[InstalledFile, ...]

    def to_json(self) -> dict:
        return {
            "ref": self.ref,
            "digest": self.digest,
            "files": {
                f.name: {"digest": f.digest, "size": f.size, "mtime_ns": f.mtime_ns}
                for f in self.files
            },
        }


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


def read_install(dest: Path) -> InstallRecord | None:
    """The record of the install in ``dest``, or None when there is none (or it is unreadable)."""
    try:
        doc = json.loads((Path(dest) / RECORD_NAME).read_text())
        files = tuple(
            InstalledFile(name, entry["digest"], int(entry["size"]), int(entry["mtime_ns"]))
            for name, entry in doc["files"].items()
        )
        return InstallRecord(str(doc["ref"]), str(doc["digest"]), files)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


@dataclass(frozen=True)
class Resolution:
    """What installing an artifact would take, found before anything is written."""

    digest: str | None  # the manifest digest the source offers (None: kept install, source down)
    bytes_needed: int  # free space the install needs beside the destination (0: up to date)
    warning: str | None = None  # the source is unreachable but a complete install is kept
    fetched: FetchedManifest | None = None  # for install_artifact: what was checked is installed


def resolve_artifact(
    ref: str | ArtifactRef,
    dest: Path,
    *,
    credentials: Credentials | None = None,
    insecure_registries: Iterable[str] = (),
    retries: int = 3,
    backoff: float = 0.5,
    max_layer_bytes: int = DEFAULT_MAX_LAYER_BYTES,
    label: str | None = None,
    deadlines: Deadlines = DEFAULT_DEADLINES,
) -> Resolution:
    """Check that ``ref`` can be installed into ``dest``: the destination is ours, the
    source answers with a valid manifest, and there is room. Writes nothing; raises
    what ``install_artifact`` would (NotOursError, ArtifactError, SourceUnreachable).
    """
    parsed = parse_ref(ref) if isinstance(ref, str) else ref
    text = label or str(parsed)
    dest = Path(dest)
    check_ours(dest)
    source = _source_for(parsed, credentials, insecure_registries, deadlines)
    current = read_install(dest) if dest.is_dir() else None
    try:
        fetched = with_retries(RetryPolicy(max(0, retries), backoff), source.fetch_manifest)
    except SourceUnreachable as exc:
        if current is None:
            raise
        return Resolution(None, 0, f"{exc}; the installed {current.ref} ({current.digest}) is kept")
    manifest = parse_manifest(fetched.data, text, expected_digest=fetched.expected_digest,
                              max_layer_bytes=max_layer_bytes, media_type=fetched.media_type)
    if current is not None and current.digest == manifest.digest:
        return Resolution(manifest.digest, 0, fetched=fetched)
    # The new files are staged beside the old install before the swap.
    return Resolution(manifest.digest, manifest.total_size, fetched=fetched)


def _source_for(parsed: ArtifactRef, credentials: Credentials | None,
                insecure_registries: Iterable[str], deadlines: Deadlines) -> Source:
    if isinstance(parsed, LayoutRef):
        return LayoutSource(parsed)
    # The registry client pulls in oras, requests and jsonschema (a third of a
    # second): only a pull pays for it, never plan or revert.
    from .remote import RegistrySource  # noqa: PLC0415

    return RegistrySource(parsed, credentials=credentials, insecure_registries=insecure_registries,
                          deadlines=deadlines)


def install_artifact(
    ref: str | ArtifactRef,
    dest: Path,
    *,
    credentials: Credentials | None = None,
    insecure_registries: Iterable[str] = (),
    retries: int = 3,
    backoff: float = 0.5,
    max_layer_bytes: int = DEFAULT_MAX_LAYER_BYTES,
    verify_files: bool = False,
    label: str | None = None,
    deadlines: Deadlines = DEFAULT_DEADLINES,
    fetched: FetchedManifest | None = None,
) -> InstallResult:
    """Make ``dest`` hold exactly the files of artifact ``ref``; see the module doc.

    ``fetched`` is the manifest ``resolve_artifact`` already read (not fetched again,
    so what was checked is what gets installed). ``verify_files`` re-hashes installed
    files even when their size and mtime match the record. ``label`` is the reference as the operator wrote it (recorded and used in
    messages), when ``ref`` was rewritten to reach it, e.g. a layout path under a host
    root. Raises ArtifactError (the previous install untouched) or ConfigError (bad ref).
    """
    parsed = parse_ref(ref) if isinstance(ref, str) else ref
    text = label or str(parsed)
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    policy = RetryPolicy(retries=max(0, retries), backoff=backoff)
    source = _source_for(parsed, credentials, insecure_registries, deadlines)
    check_ours(dest)  # before the lock file is created: a refusal writes nothing
    with _locked(dest):
        _recover(dest)
        check_ours(dest)
        current = read_install(dest) if dest.is_dir() else None
        intact = _intact_files(dest, current, verify_files) if current else {}
        complete = current is not None and len(intact) == len(current.files)
        try:
            if fetched is None:
                fetched = with_retries(policy, source.fetch_manifest)
        except SourceUnreachable as exc:
            if current is None or not complete:
                raise
            warning = f"{exc}; kept the installed {current.ref} ({current.digest}) in {dest}"
            log.warning("%s", warning)
            return InstallResult(dest.name, dest, current.ref, current.digest, False,
                                 [f.name for f in current.files], 0, warning)
        manifest = parse_manifest(
            fetched.data, text, expected_digest=fetched.expected_digest,
            max_layer_bytes=max_layer_bytes, media_type=fetched.media_type,
        )
        if complete and current is not None and current.digest == manifest.digest:
            if current.ref != text:
                record = InstallRecord(text, current.digest, current.files)
                write_atomic(dest / RECORD_NAME, _record_text(record))
            log.debug("%s: %s already holds %s, nothing to do", text, dest, manifest.digest)
            return InstallResult(dest.name, dest, text, manifest.digest, False,
                                 [layer.name for layer in manifest.layers], 0)
        transferred = _stage_and_swap(source, manifest, text, dest, intact, policy)
        return InstallResult(dest.name, dest, text, manifest.digest, True,
                             [layer.name for layer in manifest.layers], transferred)


class NotOursError(ArtifactError):
    """The destination holds something katamgr did not install."""


def check_ours(dest: Path) -> None:
    """Refuse a destination that is not ours to replace: a file, a symlink, or a
    directory with files in it but no install record (kata-deploy's /opt/kata,
    an operator's own tree). An empty directory, or none, is fine."""
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise NotOursError(f"{dest} exists and is not a directory katamgr made; it is left "
                           "as it is")
    if dest.is_dir() and read_install(dest) is None and any(dest.iterdir()):
        raise NotOursError(f"{dest} already holds files that katamgr did not install (no "
                           f"{RECORD_NAME} in it); it is left as it is")


def remove_install(dest: Path) -> bool:
    """Remove an install of ours and whatever a killed run left beside it; True when
    an install was removed. A dir that is not ours is never touched.

    The dir is first renamed aside in one step, so a crash part-way through the
    deletion leaves no half-removed install under the runtime class's name: the
    next run (install or removal) deletes the renamed leftovers.
    """
    dest = Path(dest)
    lock = dest.parent / f".{dest.name}.lock"
    if not (lock.exists() or _leftovers(dest) or read_install(dest) is not None):
        return False  # nothing of ours here: not even a lock file is created
    removed = False
    with _locked(dest):
        _recover(dest)
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


def _leftovers(dest: Path) -> list[Path]:
    """What killed installs or removals of ``dest`` left beside it (ours by name)."""
    return [p for kind in ("old", "staging", "removing")
            for p in dest.parent.glob(f".{dest.name}.{kind}-*")]


def _stage_and_swap(
    source: Source, manifest: Manifest, ref: str, dest: Path, intact: dict[str, Path],
    policy: RetryPolicy,
) -> int:
    write_point(f"stage {dest}")
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.staging-", dir=dest.parent))
    try:
        files, transferred = _fill(source, manifest, ref, staging, intact, policy)
        record = InstallRecord(ref, manifest.digest, tuple(files))
        with (staging / RECORD_NAME).open("w") as out:
            out.write(_record_text(record))
            out.flush()
            os.fsync(out.fileno())  # after a crash the swapped-in dir must hold its record
        os.chmod(staging, 0o755)
        fsync_dir(staging)
        write_point(f"swap {staging} into {dest}")
        _swap(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("%s: installed %s into %s (%d files, %d bytes downloaded)", ref, manifest.digest,
             dest, len(files), transferred)
    return transferred


def _fill(
    source: Source, manifest: Manifest, ref: str, staging: Path, intact: dict[str, Path],
    policy: RetryPolicy,
) -> tuple[list[InstalledFile], int]:
    """Put every layer's file, verified and fsynced, into ``staging``; bytes downloaded."""
    stop = threading.Event()  # set when one layer failed: the others give up at their next chunk

    def fill_one(layer: Layer) -> tuple[InstalledFile, int]:
        target = staging / layer.name
        local = intact.get(layer.digest)
        transferred = 0
        if not (local and _copy_local(local, target, layer, ref, stop)):
            transferred = with_retries(policy, lambda: _download(source, layer, target, ref, stop))
        entry = InstalledFile(layer.name, layer.digest, layer.size, target.stat().st_mtime_ns)
        return entry, transferred

    # layers download side by side: one blob's fsync and hashing overlap another's transfer
    with ThreadPoolExecutor(min(LAYER_THREADS, len(manifest.layers)) or 1,
                            thread_name_prefix="artifact-layer") as pool:
        futures = [pool.submit(fill_one, layer) for layer in manifest.layers]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
        finally:
            stop.set()  # a no-op once all are done; stops the rest after a failure or interrupt
            pool.shutdown(wait=True, cancel_futures=True)
        failures = [f.exception() for f in futures if not f.cancelled() and f.exception()]
        if failures:  # the cause, not a layer that stopped because of it
            raise next((e for e in failures if not isinstance(e, _Stopped)), failures[0])
        results = [future.result() for future in futures]
    return [entry for entry, _ in results], sum(count for _, count in results)


class _Stopped(ArtifactError):
    """A layer gave up because another layer of the same install failed."""


def _record_text(record: InstallRecord) -> str:
    return json.dumps(record.to_json(), indent=2, sort_keys=True) + "\n"


def _download(source: Source, layer: Layer, target: Path, ref: str, stop: threading.Event) -> int:
    with source.open_blob(layer) as chunks:
        _write_verified(chunks, target, layer, ref, stop, progress=True)
    return layer.size


def _copy_local(local: Path, target: Path, layer: Layer, ref: str, stop: threading.Event) -> bool:
    """Reuse an installed file with the same digest; False when it turns out damaged."""
    try:
        with local.open("rb") as handle:
            _write_verified(iter(lambda: handle.read(CHUNK_BYTES), b""), target, layer, ref, stop)
    except _Stopped:
        raise
    except (ArtifactError, OSError) as exc:
        log.info("%s: cannot reuse %s (%s); downloading it", ref, local, exc)
        return False
    return True


def _write_verified(
    chunks: Iterator[bytes], target: Path, layer: Layer, ref: str, stop: threading.Event,
    progress: bool = False,
) -> None:
    """Write ``chunks`` to ``target``, checking size and digest as they stream, then fsync."""
    hasher = hashlib.sha256()
    written = flushed = 0
    started = last_report = time.monotonic()
    report = progress and layer.size >= PROGRESS_MIN_BYTES
    if report:
        log.info("%s: downloading %s (%.1f MiB)", ref, layer.name, layer.size / 2**20)
    # a retry starts the file afresh ("wb")
    write_point(f"write {target}")
    with target.open("wb") as out, _hashing(hasher, layer.size) as hash_chunk:
        for chunk in chunks:
            if stop.is_set():
                raise _Stopped(f"{ref}: stopped {layer.name}, another layer failed")
            written += len(chunk)
            if written > layer.size:
                raise ArtifactError(
                    f"{ref}: blob {layer.digest} ({layer.name}) is longer than the manifest's "
                    f"{layer.size} bytes; the source serves wrong data, re-push the artifact"
                )
            hash_chunk(chunk)
            out.write(chunk)  # chunks are >= the buffer size: written straight, not copied
            if written - flushed >= WRITEBACK_BYTES:
                # the disk writes while we receive, so the final fsync waits only for the tail
                _start_writeback(out.fileno(), flushed, written - flushed)
                flushed = written
            if report and time.monotonic() - last_report >= PROGRESS_EVERY_SECONDS:
                last_report = time.monotonic()
                log.info("%s: %s %.1f of %.1f MiB (%d%%)", ref, layer.name, written / 2**20,
                         layer.size / 2**20, 100 * written // max(layer.size, 1))
        hash_chunk(None)
        out.flush()
        os.fsync(out.fileno())
    os.chmod(target, FILE_MODE)
    if written != layer.size:
        raise ArtifactError(
            f"{ref}: blob {layer.digest} ({layer.name}) ended after {written} of {layer.size} "
            "bytes; the source serves truncated data, re-push the artifact"
        )
    actual = "sha256:" + hasher.hexdigest()
    if actual != layer.digest:
        raise ArtifactError(
            f"{ref}: blob {layer.digest} ({layer.name}) has digest {actual}, not the manifest's; "
            "the source serves corrupt data, re-push the artifact or check the registry storage"
        )
    if report:
        seconds = max(time.monotonic() - started, 1e-6)
        log.info("%s: downloaded %s, %.1f MiB in %.1fs (%.0f MiB/s)", ref, layer.name,
                 layer.size / 2**20, seconds, layer.size / 2**20 / seconds)


@contextlib.contextmanager
def _hashing(hasher: Any, size: int) -> Iterator[Callable[[bytes | None], None]]:
    """``hash_chunk(chunk)`` feeds ``hasher``; ``hash_chunk(None)`` waits for every chunk.

    For a big blob a second thread hashes (sha256 releases the GIL on big buffers) while
    this one writes and receives the next chunks: hashing costs little throughput. Chunks
    are immutable bytes, so both threads read the same one without a copy.
    """
    if size < PIPELINE_MIN_BYTES:

        def hash_inline(chunk: bytes | None) -> None:
            if chunk is not None:
                hasher.update(chunk)

        yield hash_inline
        return
    in_flight: deque[Future] = deque()

    def hash_chunk(chunk: bytes | None) -> None:
        if chunk is None:
            while in_flight:
                in_flight.popleft().result()
            return
        if len(in_flight) >= PIPELINE_DEPTH:  # bounds the memory held by chunks not yet hashed
            in_flight.popleft().result()
        in_flight.append(pool.submit(hasher.update, chunk))

    with ThreadPoolExecutor(1, thread_name_prefix="artifact-hash") as pool:
        try:
            yield hash_chunk
        finally:
            for future in in_flight:
                future.cancel()


def _writeback_function() -> Callable[[int, int, int], None]:
    """``start(fd, offset, length)``: ask the kernel to begin writing that range to disk.

    sync_file_range(SYNC_FILE_RANGE_WRITE) only starts the writeback and does not wait;
    durability still comes from the fsync at the end. Where libc lacks it: a no-op.
    """
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return lambda fd, offset, length: None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int

    def start(fd: int, offset: int, length: int) -> None:
        function(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # a hint: its failure changes nothing

    return start


_SYNC_FILE_RANGE_WRITE = 2
_start_writeback = _writeback_function()


def _intact_files(dest: Path, record: InstallRecord, full: bool) -> dict[str, Path]:
    """Digest -> path of each recorded file still as installed."""
    intact: dict[str, Path] = {}
    for entry in record.files:
        path = dest / entry.name
        try:
            stat = path.lstat()
        except OSError:
            continue
        if not path.is_file() or path.is_symlink() or stat.st_size != entry.size:
            continue
        if full or stat.st_mtime_ns != entry.mtime_ns:
            if _file_digest(path) != entry.digest:
                log.warning("%s differs from the installed %s; it will be replaced", path,
                            entry.digest)
                continue
        intact[entry.digest] = path
    return intact


def _file_digest(path: Path) -> str:
    hasher = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1024 * 1024), b""):
            hasher.update(chunk)
    return "sha256:" + hasher.hexdigest()


@contextlib.contextmanager
def _locked(dest: Path) -> Iterator[None]:
    """One installer per runtime class dir at a time (two agents, or a CLI run beside one)."""
    lock = dest.parent / f".{dest.name}.lock"
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _recover(dest: Path) -> None:
    """Finish a swap a crash interrupted, and drop leftovers of earlier runs."""
    leftovers = sorted(dest.parent.glob(f".{dest.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if not dest.exists() and leftovers and read_install(leftovers[-1]) is not None:
        os.rename(leftovers.pop(), dest)
        fsync_dir(dest.parent)
        log.warning("restored %s from an install swap a crash interrupted", dest)
    for stale in [*leftovers, *dest.parent.glob(f".{dest.name}.staging-*"),
                  *dest.parent.glob(f".{dest.name}.removing-*")]:
        write_point(f"delete leftover {stale}")
        shutil.rmtree(stale, ignore_errors=True)


def _swap(staging: Path, dest: Path) -> None:
    if not dest.exists() and not dest.is_symlink():
        os.rename(staging, dest)
    elif dest.is_dir() and not dest.is_symlink() and _exchange(staging, dest):
        shutil.rmtree(staging, ignore_errors=True)  # staging now holds the old install
    else:
        # no atomic exchange here: a crash between the two renames leaves the old install
        # complete under .<name>.old-*, and the next run's _recover puts it back
        old = dest.parent / f".{dest.name}.old-{os.getpid()}-{time.monotonic_ns()}"
        os.rename(dest, old)
        write_point(f"rename {staging} to {dest}")
        os.rename(staging, dest)
        fsync_dir(dest.parent)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
    fsync_dir(dest.parent)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with renameat2; False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))
