"""A guest image's dm-verity root hash, checked before the image is installed.

Kata 4.x boots the NVIDIA guest from a read-only EROFS ``image`` protected by dm-verity,
and adds guest extension images the same way. The parameters are Kata's
``kernel_verity_params`` (and each extension's ``verity_params``): comma-separated
``key=value`` fields ``root_hash``, ``salt``, ``data_blocks``, ``data_block_size`` and
``hash_block_size``, every one required, the sizes non-zero multiples of 512
(``ParseKernelVerityParams``, src/runtime/virtcontainers/hypervisor.go, Kata 4.1.0). The
runtime hands the guest kernel the table ``verity 1 /dev/vda1 /dev/vda2 <data_block_size>
<hash_block_size> <data_blocks> 0 sha256 <root_hash> <salt>`` (``kernelVerityRootParams``,
same file): the data is the image's first partition, the hash tree its second from block
0 (no verity superblock), format 1, sha256; Kata's image builder partitions the disk with an
MBR (``parted mklabel msdos``, tools/osbuilder/image-builder/image_builder.sh).

So the root hash is recomputed here from the first partition alone, with that salt and
those sizes, the way dm-verity (and cryptsetup's ``veritysetup format``) builds the tree:
each block hashed as sha256(salt || block), the digests packed into hash blocks, level by
level, until one block is left; the root hash is sha256(salt || that block). A wrong
hash partition only stops the guest at boot; a data partition that is not the one the
root hash names is refused before anything is installed.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import subprocess
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

from .errors import ArtifactError

log = logging.getLogger(__name__)

FIELDS = ("root_hash", "salt", "data_blocks", "data_block_size", "hash_block_size")
SECTOR = 512  # Kata's verityBlockSizeBytes, and the partition tables' sector
DIGEST_BYTES = 32  # sha256, the only algorithm Kata's table names
READ_BYTES = 1024 * 1024


@dataclass(frozen=True)
class VerityParams:
    root_hash: str
    salt: str
    data_blocks: int
    data_block_size: int
    hash_block_size: int

    def text(self) -> str:
        """The ``kernel_verity_params`` value Kata reads back as these parameters."""
        return (f"root_hash={self.root_hash},salt={self.salt},data_blocks={self.data_blocks},"
                f"data_block_size={self.data_block_size},hash_block_size={self.hash_block_size}")


def parse_params(text: str, what: str) -> VerityParams:
    """``text`` as Kata 4.1's ParseKernelVerityParams reads it; ArtifactError naming the field."""
    values: dict[str, str] = {}
    for field in str(text).split(","):
        field = field.strip()
        if not field:
            continue
        key, sep, value = field.partition("=")
        if not sep:
            raise ArtifactError(f"{what}: the dm-verity parameter {field!r} is not key=value; give "
                                f"{', '.join(f + '=...' for f in FIELDS)}")
        values[key] = value
    missing = [f for f in FIELDS if not values.get(f)]
    if missing:
        raise ArtifactError(f"{what}: the dm-verity parameters {text!r} lack {', '.join(missing)}; Kata refuses "
                            "them too, give every one of " + ", ".join(FIELDS))
    sizes = {}
    for key in FIELDS[2:]:
        try:
            sizes[key] = int(values[key], 10)
        except ValueError:
            raise ArtifactError(f"{what}: dm-verity {key}={values[key]!r} is not a whole number") from None
        if sizes[key] <= 0 or (key != "data_blocks" and sizes[key] % SECTOR):
            raise ArtifactError(f"{what}: dm-verity {key}={sizes[key]} must be non-zero"
                                + ("" if key == "data_blocks" else f" and a multiple of {SECTOR}"))
    try:
        bytes.fromhex(values["salt"])
        if len(bytes.fromhex(values["root_hash"])) != DIGEST_BYTES:
            raise ValueError
    except ValueError:
        raise ArtifactError(f"{what}: dm-verity root_hash and salt must be hex, the root hash "
                            f"{DIGEST_BYTES} bytes (sha256)") from None
    return VerityParams(values["root_hash"].lower(), values["salt"].lower(), sizes["data_blocks"],
                        sizes["data_block_size"], sizes["hash_block_size"])


def partitions(path: Path) -> list[tuple[int, int]]:
    """(offset, length) in bytes of each primary partition of the disk image's MBR, in table
    order: the layout Kata's image builder writes (``parted mklabel msdos``)."""
    with path.open("rb") as disk:
        return mbr_partitions(disk.read(SECTOR))


def mbr_partitions(mbr: bytes) -> list[tuple[int, int]]:
    if len(mbr) < SECTOR or mbr[510:512] != b"\x55\xaa":
        return []
    entries = [struct.unpack_from("<4xB3xII", mbr, 446 + 16 * i) for i in range(4)]
    return [(start * SECTOR, count * SECTOR) for kind, start, count in entries if kind and count]


def root_hash(path: Path, params: VerityParams, offset: int = 0) -> str:
    """The dm-verity root hash of ``params.data_blocks`` blocks of ``path`` from ``offset``."""
    salted = hashlib.sha256(bytes.fromhex(params.salt))  # each block's hash starts from the salt's state
    size = params.data_block_size
    digests: list[bytes] = []
    left = params.data_blocks
    with path.open("rb", buffering=0) as data:
        data.seek(offset)
        while left:
            count = min(left, max(1, READ_BYTES // size))
            chunk = memoryview(data.read(count * size))
            if len(chunk) != count * size:
                raise ArtifactError(f"{path.name}: the data ends before dm-verity's {params.data_blocks} blocks of "
                                    f"{size} bytes; the image and its parameters do not match")
            digests += [_hash(salted, chunk[i:i + size]) for i in range(0, count * size, size)]
            left -= count
    return root_of(digests, params)


def root_of(digests: list[bytes], params: VerityParams) -> str:
    """The root hash over the data blocks' digests: the tree's levels, up to one block."""
    salted = hashlib.sha256(bytes.fromhex(params.salt))
    per_block = params.hash_block_size // DIGEST_BYTES
    while len(digests) > 1:  # one data block is its own root: the tree has no level
        blocks = [b"".join(digests[i:i + per_block]).ljust(params.hash_block_size, b"\0")
                  for i in range(0, len(digests), per_block)]
        digests = [_hash(salted, block) for block in blocks]
    return digests[0].hex()


HEAD_CAP = 16 * 1024 * 1024  # bytes held while the parameters are not known yet
WORKER = Path(__file__).with_name("verity_worker.py")
WORKER_SECONDS = 600.0  # the worker's last blocks after the download: a local file read


class StreamingBlocks:
    """The data blocks' digests of a guest image taken as the image downloads (a download's
    ``tap``), so that its root hash costs no second pass: a process of its own
    (``verity_worker``) reads the blocks from the file as they are written, on another core,
    while this one receives the rest. ``params_for()`` says whether the parameters can be known
    yet and names them (None: the image has none, nothing is hashed and the check reads the
    file instead); until they can, the image's first bytes are held here, up to HEAD_CAP."""

    def __init__(self, params_for, path: Path) -> None:
        self.params_for = params_for
        self.path = path
        self.head = bytearray()
        self.params: VerityParams | None = None
        self.offset = -1  # where the data partition starts; -1: not known yet, -2: not hashed
        self.worker: subprocess.Popen | None = None
        self.hashed = 0  # data blocks the worker hashed while the image streamed

    def __call__(self, chunk: bytes) -> None:
        if self.offset == -1:
            self.head += chunk
            if len(self.head) < SECTOR or not self._begin():
                return
        if self.worker is not None:
            self._tell(b".")  # more of the file is on its way to disk: the worker reads on

    def _begin(self) -> bool:
        """Whether hashing starts now (else the head is held, or hashing is given up)."""
        ready, params = self.params_for()
        parts = mbr_partitions(bytes(self.head[:SECTOR]))
        if not ready and len(self.head) <= HEAD_CAP:
            return False
        self.head = bytearray()
        if params is None or len(parts) < 2:
            self.offset = -2
            return False
        self.params, self.offset = params, parts[0][0]
        try:
            self.worker = subprocess.Popen(
                [sys.executable, "-I", "-S", str(WORKER), str(self.path), str(self.offset), str(params.data_blocks),
                 str(params.data_block_size), params.salt],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True)
        except OSError as exc:  # the check reads the file once the download is done
            log.info("%s: no dm-verity worker (%s); its blocks are hashed after the download", self.path.name, exc)
            self.offset = -2
            return False
        weakref.finalize(self, _stop, self.worker)
        return True

    def _tell(self, message: bytes) -> None:
        if self.worker.stdin is None:
            return  # told the file is complete already
        try:
            if message:
                self.worker.stdin.write(message)
                self.worker.stdin.flush()
            else:
                stdin, self.worker.stdin = self.worker.stdin, None  # communicate() then leaves it be
                stdin.close()
        except (OSError, ValueError):
            pass  # the worker ended: root() reads why and the check falls back to the file

    def finish(self) -> None:
        """The file is complete (the download wrote and fsynced every byte)."""
        if self.offset == -1 and len(self.head) >= SECTOR:
            self._begin()  # all of it held: the worker reads it from the file
        if self.worker is not None:
            self._tell(b"")

    def root(self, params: VerityParams, offset: int) -> str | None:
        """The root hash, when the worker hashed every block with these parameters and offset."""
        self.finish()
        worker, self.worker = self.worker, None
        if worker is None or self.params != params or self.offset != offset:
            if worker is not None:
                _stop(worker)
            return None
        try:
            out, err = worker.communicate(timeout=WORKER_SECONDS)
        except subprocess.TimeoutExpired:
            _stop(worker)
            return None
        if worker.returncode != 0 or len(out) != params.data_blocks * DIGEST_BYTES:
            log.info("%s: the dm-verity worker gave no digests (%s); reading the file", self.path.name,
                     err.decode(errors="replace").strip() or f"exit {worker.returncode}")
            return None
        self.hashed = params.data_blocks
        return root_of([out[i:i + DIGEST_BYTES] for i in range(0, len(out), DIGEST_BYTES)], params)

    def close(self) -> None:
        """A download attempt abandoned: its worker goes."""
        worker, self.worker = self.worker, None
        if worker is not None:
            _stop(worker)


def _stop(worker: subprocess.Popen) -> None:
    if worker.poll() is None:
        worker.kill()
    for pipe in (worker.stdin, worker.stdout, worker.stderr):
        try:
            if pipe is not None:
                pipe.close()
        except OSError:
            pass  # a pipe to a killed worker
    worker.wait()


def _hash(salted, block) -> bytes:
    digest = salted.copy()
    digest.update(block)
    return digest.digest()


def check_image(path: Path, params_text: str, what: str, streamed: StreamingBlocks | None = None) -> VerityParams:
    """Refuse ``path`` unless its first partition has the root hash ``params_text`` names
    (from the blocks ``streamed`` hashed during the download, when it has them all)."""
    params = parse_params(params_text, what)
    parts = partitions(path)
    if len(parts) < 2:
        raise ArtifactError(f"{what}: {path.name} has {len(parts)} MBR partition(s); a dm-verity guest image holds "
                            "its data in the first partition and the hash tree in the second, as Kata's image "
                            "builder writes it")
    (start, length), _ = parts[0], parts[1]
    if params.data_blocks * params.data_block_size > length:
        raise ArtifactError(f"{what}: dm-verity covers {params.data_blocks} blocks of {params.data_block_size} bytes, "
                            f"more than {path.name}'s data partition ({length} bytes)")
    actual = (streamed.root(params, start) if streamed is not None else None) or root_hash(path, params, start)
    if actual != params.root_hash:
        raise ArtifactError(f"{what}: {path.name} has dm-verity root hash {actual}, not the {params.root_hash} its "
                            "parameters name; the image was altered or belongs to other parameters, refusing to "
                            "install it (re-push the image with its own parameters)")
    return params
