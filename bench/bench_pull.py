"""Artifact pull throughput: install_artifact vs a raw HTTP GET of the same blobs.

Starts the real docker-registry on 127.0.0.1, pushes a ~64 MiB artifact (3 blobs) with
oras-py, then runs N rounds; each round times, in an order that rotates between rounds:
- raw GET + fsync (THE BASELINE): http.client GETs every blob in turn, writes it to a file
  and fsyncs the file. That is the necessary work of any correct download: a file that is
  not durable before it is put in use is not downloaded yet. The target is
  install_artifact at >= 0.95 of this throughput.
- raw GET (no fsync): the same without the fsync; printed for reference only, since it
  leaves the data in the page cache.
- raw GET + fsync, overlapped: the baseline with install_artifact's scheduling tricks (all
  blobs at once, writeback started every WRITEBACK_BYTES); for reference, to show how much of the
  install's speed comes from overlap and how much verification still costs.
- install_artifact: the same blobs, verified (sha256 + size) while streaming, fsynced,
  swapped into place atomically. Hashing is extra work only the install does; it may
  overlap the network, which is what install_artifact does.
Ratios are baseline time / install time: the median of the per-round ratios, and the
best baseline time over the best install time. The shared 2-core machine makes single
rounds swing, so read the median and run it a few times. Also prints the
time and bytes of a second, no-change install (target: 0 bytes).

With ``--guest erofs`` the artifact is a Kata 4.1 NVIDIA guest instead: a kernel, an EROFS
base image and a GPU extension image (each an MBR disk with its dm-verity tree, made by
veritysetup: tests/support/veritykit.py) and the Kata config naming them with their
parameters; install_artifact then also recomputes each image's dm-verity root hash before
the swap (``katamgr.runtime.guest_images.GuestCheck``, the blocks hashed as they stream), work the baseline does not do.

    .venv/bin/python bench/bench_pull.py [--mib 64] [--rounds 11] [--guest initrd|erofs]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from support.registry_server import run_registry  # noqa: E402
from support.veritykit import BLOCK, guest_image  # noqa: E402

from katamgr.artifacts import install_artifact  # noqa: E402
from katamgr.artifacts.verified import WRITEBACK_BYTES, start_writeback  # noqa: E402
from katamgr.runtime.guest_images import GuestCheck  # noqa: E402

CHUNK = 1024 * 1024


def make_files(workdir: Path, total_mib: int) -> list[Path]:
    sizes = {
        "vmlinux-nvidia-gpu": total_mib // 4 * CHUNK,
        "kata-ubuntu-jammy-nvidia-gpu.initrd": (total_mib - total_mib // 4) * CHUNK,
        "configuration-qemu-nvidia-gpu.toml": 4096,
    }
    paths = []
    for name, size in sizes.items():
        path = workdir / name
        with path.open("wb") as out:
            remaining = size
            while remaining:
                block = os.urandom(min(CHUNK, remaining))
                out.write(block)
                remaining -= len(block)
        paths.append(path)
    return paths


def make_guest(workdir: Path, total_mib: int) -> list[Path]:
    """Kernel (1/8), EROFS base image (5/8) and GPU extension (1/4), and the Kata config."""
    kernel = workdir / "vmlinux-nvidia-gpu"
    kernel.write_bytes(os.urandom(total_mib // 8 * CHUNK))
    base = guest_image(workdir / "kata-containers-nvidia.img", total_mib * 5 // 8 * CHUNK // BLOCK)
    gpu = guest_image(workdir / "kata-containers-nvidia-gpu.img", total_mib // 4 * CHUNK // BLOCK)
    config = workdir / "configuration-qemu-nvidia-gpu.toml"
    config.write_text(f"""[hypervisor.qemu]
kernel = "/opt/kata/share/kata-containers/vmlinux-nvidia-gpu"
image = "/opt/kata/share/kata-containers/kata-containers-nvidia.img"
rootfs_type = "erofs"
kernel_verity_params = "{base}"

[[hypervisor.qemu.guest_extension_images]]
name = "nvidia-gpu"
path = "/opt/kata/share/kata-containers/kata-containers-nvidia-gpu.img"
verity_params = "{gpu}"
""")
    return [kernel, workdir / "kata-containers-nvidia.img", workdir / "kata-containers-nvidia-gpu.img", config]


def raw_get(
    host: str, repo: str, digests: list[str], outdir: Path, durable: bool = False,
    early: bool = False,
) -> int:
    outdir.mkdir(parents=True, exist_ok=True)
    address, port = host.rsplit(":", 1)
    connection = http.client.HTTPConnection(address, int(port), timeout=60)
    total = 0
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    try:
        for digest in digests:
            connection.request("GET", f"/v2/{repo}/blobs/{digest}")
            response = connection.getresponse()
            if response.status != 200:
                raise RuntimeError(f"raw GET of {digest} answered {response.status}")
            with (outdir / digest.split(":")[1]).open("wb") as out:
                flushed = written = 0
                while count := response.readinto(buffer):
                    out.write(view[:count])
                    written += count
                    if early and written - flushed >= WRITEBACK_BYTES:
                        start_writeback(out.fileno(), flushed, written - flushed)
                        flushed = written
                total += written
                if durable:
                    out.flush()
                    os.fsync(out.fileno())
    finally:
        connection.close()
    return total


def raw_get_overlapped(host: str, repo: str, digests: list[str], outdir: Path) -> int:
    """raw_get(durable=True) with every blob on its own connection and early writeback."""
    with ThreadPoolExecutor(len(digests)) as pool:
        return sum(pool.map(
            lambda digest: raw_get(host, repo, [digest], outdir, durable=True, early=True),
            digests,
        ))


def manifest_digests(host: str, repo: str, tag: str) -> list[str]:
    address, port = host.rsplit(":", 1)
    connection = http.client.HTTPConnection(address, int(port), timeout=10)
    connection.request("GET", f"/v2/{repo}/manifests/{tag}",
                       headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    manifest = json.loads(connection.getresponse().read())
    connection.close()
    return [layer["digest"] for layer in manifest["layers"]]


BASELINE = "raw GET + fsync"
TARGET = 0.95
CASES = ("raw GET (no fsync)", BASELINE, "raw GET + fsync, overlapped", "install_artifact")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="artifact size in MiB")
    parser.add_argument("--rounds", type=int, default=11, help="rounds (median and best)")
    parser.add_argument("--guest", choices=("initrd", "erofs"), default="initrd",
                        help="kernel + initrd, or kernel + EROFS base + extension with dm-verity")
    args = parser.parse_args()
    check = GuestCheck if args.guest == "erofs" else (lambda: None)

    times: dict[str, list[float]] = {case: [] for case in CASES}
    with tempfile.TemporaryDirectory(prefix="bench-pull-") as tmp:
        work = Path(tmp)
        with run_registry(work / "registry") as registry:
            (work / "src").mkdir()
            files = (make_guest if args.guest == "erofs" else make_files)(work / "src", args.mib)
            repo, tag = "kata/bench", "v1"
            registry.push_files(f"{repo}:{tag}", files)
            digests = manifest_digests(registry.host, repo, tag)
            size = sum(p.stat().st_size for p in files)
            ref = f"{registry.host}/{repo}:{tag}"

            def run(case: str, out: Path) -> None:
                started = time.perf_counter()
                if case == "install_artifact":
                    result = install_artifact(ref, out, check=check())
                    assert result.changed and result.bytes_transferred == size
                elif case == "raw GET + fsync, overlapped":
                    assert raw_get_overlapped(registry.host, repo, digests, out) == size
                else:
                    durable = case == BASELINE
                    assert raw_get(registry.host, repo, digests, out, durable) == size
                times[case].append(time.perf_counter() - started)

            raw_get(registry.host, repo, digests, work / "warm-up")  # registry page cache
            install_artifact(ref, work / "warm-up-install", check=check())  # imports, first connection
            for number in range(args.rounds):
                shift = number % len(CASES)  # each case goes first in some rounds
                for index, case in enumerate(CASES[shift:] + CASES[:shift]):
                    out = work / f"round-{number}-{index}"
                    run(case, out)
                    shutil.rmtree(out)  # keep the page cache from filling up with earlier rounds

            dest = work / "again"
            install_artifact(ref, dest, check=check())
            started = time.perf_counter()
            again = install_artifact(ref, dest, check=check())
            no_change = time.perf_counter() - started

    mib = size / 2**20
    install = times["install_artifact"]
    print(f"artifact ({args.guest}): {mib:.1f} MiB in {len(files)} blobs, {args.rounds} rounds (order rotates); "
          f"target: install_artifact >= {TARGET:.2f} of the '{BASELINE}' throughput")
    print(f"{'':30}{'median':>8} {'best':>8}  {'MiB/s med':>9}  ratio: median of rounds / best vs best")
    for case in CASES:
        series = times[case]
        line = (f"{case + ':':30}{statistics.median(series):7.3f}s {min(series):7.3f}s  "
                f"{mib / statistics.median(series):9.1f}")
        if case != "install_artifact":
            paired = [base / own for base, own in zip(series, install, strict=True)]
            line += f"  {statistics.median(paired):5.2f} / {min(series) / min(install):4.2f}"
            if case == BASELINE:
                line += f"  <- target >= {TARGET:.2f}: " + (
                    "OK" if statistics.median(paired) >= TARGET else "BELOW")
        print(line)
    print("install_artifact = sha256 + size verified while streaming, fsynced, atomic swap; "
          "'overlapped' = the baseline with the install's overlap, for reference")
    print(f"no-change run: {no_change * 1000:.1f} ms, {again.bytes_transferred} bytes "
          f"transferred, changed={again.changed}  (target: 0 bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
