"""Guest disk images with a dm-verity tree, the way Kata's image builder lays them out.

An MBR disk (``parted mklabel msdos``), the data in partition 1 from 1 MiB, the hash tree in
partition 2 from its first block with no verity superblock: the table Kata 4.1's
``kernelVerityRootParams`` hands the guest (virtcontainers/hypervisor.go). The tree and its
root hash are made by cryptsetup's ``veritysetup format``, not by our code.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

VERITYSETUP = shutil.which("veritysetup") or next(
    (p for p in ("/usr/sbin/veritysetup", "/sbin/veritysetup") if os.path.exists(p)), None)
SECTOR, BLOCK, START = 512, 4096, 2048  # partition 1 at 1 MiB, as parted -a optimal puts it


def guest_image(path: Path, blocks: int) -> str:
    """An image at ``path`` holding ``blocks`` random 4 KiB blocks; its kernel_verity_params."""
    if VERITYSETUP is None:
        raise RuntimeError("veritysetup (Debian's cryptsetup-bin) is missing; run .ci/setup")
    work = path.parent / f".{path.name}.parts"
    work.mkdir(parents=True)
    data, tree = work / "data", work / "hash"
    with data.open("wb") as out:
        for start in range(0, blocks, 256):
            out.write(os.urandom(min(256, blocks - start) * BLOCK))
    salt = os.urandom(32).hex()
    out = subprocess.run([VERITYSETUP, "format", "--no-superblock", f"--salt={salt}", str(data), str(tree)],
                         capture_output=True, text=True, check=True).stdout
    root = re.search(r"Root hash:\s*([0-9a-f]{64})", out).group(1)
    tree_bytes = tree.read_bytes()
    data_sectors = blocks * BLOCK // SECTOR
    hash_sectors = -(-len(tree_bytes) // SECTOR)
    mbr = bytearray(SECTOR)
    struct.pack_into("<4xB3xII", mbr, 446, 0x83, START, data_sectors)
    struct.pack_into("<4xB3xII", mbr, 462, 0x83, START + data_sectors, hash_sectors)
    mbr[510:512] = b"\x55\xaa"
    with path.open("wb") as disk, data.open("rb") as source:
        disk.write(mbr)
        disk.seek(START * SECTOR)
        shutil.copyfileobj(source, disk, 1024 * 1024)
        disk.write(tree_bytes.ljust(hash_sectors * SECTOR, b"\0"))
    shutil.rmtree(work)
    return f"root_hash={root},salt={salt},data_blocks={blocks},data_block_size={BLOCK},hash_block_size={BLOCK}"
