"""Artifact pull throughput: install_artifact vs a raw HTTP GET of the same blobs.

Starts the real docker-registry on 127.0.0.1, pushes a ~64 MiB artifact with oras-py,
then, best of N rounds each:
- raw: http.client GET of every blob, written to a file (what any pull must at least
  do), and the same with an fsync per file (the durability the installer gives);
- install_artifact: the same blobs, verified (sha256 + size) while streaming, fsynced,
  swapped into place.
Prints the throughput ratio against each baseline (target >= 0.9) and the time and bytes
of a second, no-change install (target: 0 bytes). On a shared 2-core machine the
figures swing between runs; compare the best-of ratios of a few runs.

    .venv/bin/python bench/bench_pull.py [--mib 64] [--rounds 3]
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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from registry import run_registry  # noqa: E402

from katamgr.artifacts import install_artifact  # noqa: E402

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


def raw_get(host: str, repo: str, digests: list[str], outdir: Path, durable: bool = False) -> int:
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
                while count := response.readinto(buffer):
                    out.write(view[:count])
                    total += count
                if durable:
                    out.flush()
                    os.fsync(out.fileno())
    finally:
        connection.close()
    return total


def manifest_digests(host: str, repo: str, tag: str) -> list[str]:
    address, port = host.rsplit(":", 1)
    connection = http.client.HTTPConnection(address, int(port), timeout=10)
    connection.request("GET", f"/v2/{repo}/manifests/{tag}",
                       headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    manifest = json.loads(connection.getresponse().read())
    connection.close()
    return [layer["digest"] for layer in manifest["layers"]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="artifact size in MiB")
    parser.add_argument("--rounds", type=int, default=5, help="best of this many rounds")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-pull-") as tmp:
        work = Path(tmp)
        with run_registry(work / "registry") as registry:
            (work / "src").mkdir()
            files = make_files(work / "src", args.mib)
            repo, tag = "kata/bench", "v1"
            registry.push_files(f"{repo}:{tag}", files)
            digests = manifest_digests(registry.host, repo, tag)
            size = sum(p.stat().st_size for p in files)
            ref = f"{registry.host}/{repo}:{tag}"

            raw_times, durable_times, install_times = [], [], []

            def raw_round(number: int) -> None:
                for durable, times in ((False, raw_times), (True, durable_times)):
                    raw_dir = work / f"raw-{number}"
                    started = time.perf_counter()
                    got = raw_get(registry.host, repo, digests, raw_dir, durable)
                    times.append(time.perf_counter() - started)
                    assert got == size, (got, size)
                    shutil.rmtree(raw_dir)

            def install_round(number: int) -> Path:
                dest = work / "artifacts" / f"round-{number}"
                started = time.perf_counter()
                result = install_artifact(ref, dest)
                install_times.append(time.perf_counter() - started)
                assert result.changed and result.bytes_transferred == size
                return dest

            raw_get(registry.host, repo, digests, work / "warm-up")  # registry page cache
            for number in range(args.rounds):
                if number % 2:
                    dest = install_round(number)
                    raw_round(number)
                else:
                    raw_round(number)
                    dest = install_round(number)
                if number:  # keep the page cache from filling up with earlier rounds
                    shutil.rmtree(work / "artifacts" / f"round-{number - 1}")

            started = time.perf_counter()
            again = install_artifact(ref, dest)
            no_change = time.perf_counter() - started

    mib = size / 2**20
    install_rate = mib / min(install_times)
    print(f"artifact: {mib:.1f} MiB in {len(files)} blobs, best of {args.rounds} rounds "
          "(rounds alternate which goes first)")
    print(f"install_artifact:        {min(install_times):.3f} s  {install_rate:8.1f} MiB/s  "
          "(sha256 + size verified while streaming, fsynced, atomic swap)")
    for label, times in (("raw GET to file", raw_times), ("raw GET to file+fsync", durable_times)):
        ratio = min(times) / min(install_times)
        median = statistics.median(times) / statistics.median(install_times)
        print(f"{label + ':':<25}{min(times):.3f} s  {mib / min(times):8.1f} MiB/s  "
              f"ratio {ratio:.2f} best, {median:.2f} median  (target >= 0.90) "
              f"{'OK' if ratio >= 0.9 else 'BELOW'}")
    print(f"no-change run:     {no_change * 1000:.1f} ms, {again.bytes_transferred} bytes "
          f"transferred, changed={again.changed}  (target: 0 bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
