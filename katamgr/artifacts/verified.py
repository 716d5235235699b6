"""A blob written to disk only as the manifest describes it: ``write_verified``.

The bytes are checked while they stream (never longer than the manifest's size, then its
sha256 and exact size), written straight through, started on their way to disk every few
MiB so that the final fsync waits only for the tail, and fsynced. A big blob is hashed on a
second thread while this one receives the next chunks.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gpunode.host.faults import write_point

from .errors import ArtifactError
from .manifest import Layer

log = logging.getLogger(__name__)

PROGRESS_MIN_BYTES = 8 * 1024 * 1024
PROGRESS_EVERY_SECONDS = 2.0
PIPELINE_MIN_BYTES = 4 * 1024 * 1024  # smaller blobs are hashed inline: a thread costs more
PIPELINE_DEPTH = 8  # chunks (of up to 1 MiB) received ahead of the hashing thread
WRITEBACK_BYTES = 8 * 1024 * 1024  # start writing each 8 MiB to disk as soon as it is written
FILE_MODE = 0o644


class Stopped(ArtifactError):
    """A layer gave up because another layer of the same install failed."""


class _Tapped:
    """A sha256 whose every chunk also goes to ``tap`` (on the same thread, in order)."""

    def __init__(self, tap: Callable[[bytes], None]) -> None:
        self.inner, self.tap = hashlib.sha256(), tap

    def update(self, chunk: bytes) -> None:
        self.inner.update(chunk)
        self.tap(chunk)

    def hexdigest(self) -> str:
        return self.inner.hexdigest()


def write_verified(
    chunks: Iterator[bytes], target: Path, layer: Layer, ref: str, stop: threading.Event,
    progress: bool = False, tap: Callable[[bytes], None] | None = None,
) -> None:
    """Write ``chunks`` to ``target``, checking size and digest as they stream, then fsync.
    ``tap`` sees every chunk too, on the hashing thread (a guest image's dm-verity blocks)."""
    hasher: Any = _Tapped(tap) if tap is not None else hashlib.sha256()
    started = time.monotonic()
    report = progress and layer.size >= PROGRESS_MIN_BYTES
    if report:
        log.info("%s: downloading %s (%.1f MiB)", ref, layer.name, layer.size / 2**20)
    # a retry starts the file afresh ("wb")
    write_point(f"write {target}")
    try:
        written = _write(chunks, target, layer, ref, stop, hasher, report, started)
    except OSError as exc:
        if exc.filename is None:  # write(2) and fsync(2) name no file: a full disk must say which
            raise OSError(exc.errno, exc.strerror, str(target)) from exc
        raise
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


def _write(chunks: Iterator[bytes], target: Path, layer: Layer, ref: str, stop: threading.Event, hasher: Any,
           report: bool, started: float) -> int:
    """The stream into ``target``, hashed as it goes and fsynced; the bytes written."""
    written = flushed = 0
    last_report = started
    with target.open("wb") as out, _hashing(hasher, layer.size) as hash_chunk:
        for chunk in chunks:
            if stop.is_set():
                raise Stopped(f"{ref}: stopped {layer.name}, another layer failed")
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
                start_writeback(out.fileno(), flushed, written - flushed)
                flushed = written
            if report and time.monotonic() - last_report >= PROGRESS_EVERY_SECONDS:
                last_report = time.monotonic()
                log.info("%s: %s %.1f of %.1f MiB (%d%%)", ref, layer.name, written / 2**20,
                         layer.size / 2**20, 100 * written // max(layer.size, 1))
        hash_chunk(None)
        out.flush()
        os.fsync(out.fileno())
    return written


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
start_writeback = _writeback_function()
