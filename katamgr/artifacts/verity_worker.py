"""The data blocks' dm-verity digests of a guest image being downloaded, in a process of its own.

Run as ``python -I -S verity_worker.py PATH OFFSET BLOCKS BLOCK_SIZE SALT`` (standard library
only: it imports nothing of katamgr). It reads ``BLOCKS`` blocks of ``PATH`` from ``OFFSET`` as
the download writes them, each hashed as sha256(salt || block), the first level of the tree
dm-verity (and cryptsetup's ``veritysetup format``) builds. Any byte on stdin says more of the
file was written; end of stdin says it is complete. On stdout: the digests, 32 bytes each,
in block order; exit 1 with the reason on stderr when the file ends first.

Why a process: CPython holds the interpreter lock across each per-block call, so hashing 4 KiB
blocks on a thread of the downloading process slows its transfer on a machine with few cores;
a process of its own hashes on another core while the download runs.
"""

from __future__ import annotations

import hashlib
import os
import sys

READ_BYTES = 1024 * 1024


def digests(path: str, offset: int, blocks: int, size: int, salt: bytes, more) -> bytes:
    """The blocks' digests; ``more()`` waits for more of the file, False once it is complete."""
    salted = hashlib.sha256(salt)
    out = bytearray()
    end = offset + blocks * size
    position, partial, complete = offset, b"", False
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        while position < end:
            data = os.pread(fd, min(READ_BYTES - len(partial), end - position), position)
            if not data:
                if complete:
                    raise EOFError(f"{path} ends at byte {position}, before the {blocks} blocks of {size} bytes")
                complete = not more()
                continue
            position += len(data)
            view = memoryview(partial + data if partial else data)
            whole = len(view) - len(view) % size
            for start in range(0, whole, size):
                digest = salted.copy()
                digest.update(view[start:start + size])
                out += digest.digest()
            partial = bytes(view[whole:])
    finally:
        os.close(fd)
    return bytes(out)


def main(argv: list[str]) -> int:
    path, offset, blocks, size, salt = argv[1], int(argv[2]), int(argv[3]), int(argv[4]), bytes.fromhex(argv[5])
    stdin = sys.stdin.buffer
    try:
        found = digests(path, offset, blocks, size, salt, lambda: bool(stdin.read1(65536)))
    except (OSError, EOFError) as exc:
        sys.stderr.write(f"{exc}\n")
        return 1
    sys.stdout.buffer.write(found)
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
