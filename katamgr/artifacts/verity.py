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
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import ArtifactError

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


def is_gpt(mbr: bytes) -> bool:
    """Whether the disk's MBR is GPT's protective one (a partition of type 0xEE)."""
    return (len(mbr) >= SECTOR and mbr[510:512] == b"\x55\xaa"
            and any(mbr[446 + 16 * i + 4] == 0xEE for i in range(4)))


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


class StreamingBlocks:
    """The data blocks' digests of a guest image hashed as its bytes stream in (a download's
    ``tap``), so that its root hash costs no second pass. ``params_for()`` says whether the
    parameters can be known yet and names them (None: the image has none, nothing is hashed
    and the check reads the file instead); until they can, the first bytes are held, up to
    HEAD_CAP."""

    def __init__(self, params_for) -> None:
        self.params_for = params_for
        self.head = bytearray()
        self.seen = 0  # bytes of the image so far
        self.params: VerityParams | None = None
        self.offset = -1  # where the data partition starts; -1: not known yet, -2: not hashed
        self.digests: list[bytes] = []
        self.partial = bytearray()

    def __call__(self, chunk: bytes) -> None:
        start, self.seen = self.seen, self.seen + len(chunk)
        if self.offset == -2:
            return
        if self.offset == -1:
            self.head += chunk
            if len(self.head) < SECTOR or not self._begin():
                return
            chunk, start, self.head = bytes(self.head), 0, bytearray()
        params = self.params
        end = self.offset + params.data_blocks * params.data_block_size
        low, high = max(start, self.offset + len(self.digests) * params.data_block_size + len(self.partial)), \
            min(self.seen, end)
        if high <= low:
            return
        piece = memoryview(chunk)[low - start:high - start]
        size = params.data_block_size
        if self.partial:
            need = size - len(self.partial)
            self.partial += piece[:need]
            piece = piece[need:]
            if len(self.partial) < size:
                return
            self.digests.append(_hash(self.salted, self.partial))
            self.partial = bytearray()
        whole = len(piece) - len(piece) % size
        self.digests += [_hash(self.salted, piece[i:i + size]) for i in range(0, whole, size)]
        self.partial += piece[whole:]

    def _begin(self) -> bool:
        """Whether hashing starts now (else the head is held, or hashing is given up)."""
        ready, params = self.params_for()
        parts = mbr_partitions(bytes(self.head[:SECTOR]))
        if not ready and len(self.head) <= HEAD_CAP:
            return False
        if params is None or len(parts) < 2:
            self.offset, self.head = -2, bytearray()
            return False
        self.params, self.offset = params, parts[0][0]
        self.salted = hashlib.sha256(bytes.fromhex(params.salt))
        return True

    def root(self, params: VerityParams, offset: int) -> str | None:
        """The root hash, when every block streamed by with these parameters and offset."""
        if self.offset == -1 and len(self.head) >= SECTOR and self._begin():  # all of it held
            head, self.head, self.seen = bytes(self.head), bytearray(), 0
            self(head)
        if self.params != params or self.offset != offset or len(self.digests) != params.data_blocks:
            return None
        return root_of(self.digests, params)


def _hash(salted, block) -> bytes:
    digest = salted.copy()
    digest.update(block)
    return digest.digest()


def check_image(path: Path, params_text: str, what: str, streamed: StreamingBlocks | None = None) -> VerityParams:
    """Refuse ``path`` unless its first partition has the root hash ``params_text`` names
    (from the blocks ``streamed`` hashed during the download, when it has them all)."""
    params = parse_params(params_text, what)
    with path.open("rb") as disk:
        if is_gpt(disk.read(SECTOR)):
            raise ArtifactError(f"{what}: {path.name} is a GPT disk; Kata reads a dm-verity guest image's partitions "
                                "from an MBR table (data first, hash tree second), as its image builder writes "
                                "it (parted mklabel msdos): rebuild the image with an MBR table")
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
