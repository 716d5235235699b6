"""One architecture's image: the project's wheel, the root filesystem mmdebstrap makes by
recipe.py, its checks, and the OCI image part in the cache (the pause image's too)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from datetime import UTC, datetime
from pathlib import Path

import oci
import recipe
import wheels
from buildcache import remove_tree
from buildenv import HERE, PROG, REPO, cache_root, log, run
from buildinputs import MIRROR, PAUSE_REF, SECURITY, go_binary, host_arch
from recipe import Platform
from wheels import Failure


def project_wheel(files: list[str], dest: Path, epoch: int) -> Path:
    """This package's wheel, built from a copy of its git-tracked files (what the key
    hashed), never from the working tree itself. Pure Python: every architecture's."""
    src = dest / "src"
    for rel in files:
        if rel.startswith(("hack/", "deploy/", "requirements/")):
            continue
        target = src / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, target)
    out = dest / "project-wheel"
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(epoch), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    # .venv's setuptools when it is new enough for pyproject's build-system, else an
    # isolated build environment from PyPI.
    isolation = []
    try:
        from importlib import metadata

        if int(metadata.version("setuptools").split(".")[0]) >= 77:
            isolation = ["--no-build-isolation"]
    except metadata.PackageNotFoundError:
        pass
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "--wheel-dir",
         str(out), str(src)], env=env, what="pip wheel (kata-sandbox-manager)")
    built = list(out.glob("*.whl"))
    if len(built) != 1 or not built[0].name.endswith("-none-any.whl"):
        raise Failure(f"expected one pure wheel of kata-sandbox-manager, got {built}")
    return built[0]


def check_emulation(target: Platform) -> None:
    """A foreign architecture's root filesystem runs its maintainer scripts and our hook
    under qemu-user, through the kernel's binfmt_misc."""
    if target == host_arch():
        return
    fix = ("apt-get install qemu-user-static binfmt-support arch-test && "
           f"update-binfmts --enable qemu-{target.machine}")
    if not shutil.which("arch-test"):
        raise Failure(f"building {target.name} on {host_arch().name} needs qemu-user; run: {fix}")
    proc = subprocess.run(["arch-test", target.arch], capture_output=True, text=True)  # noqa: S603, S607
    if proc.returncode or proc.stdout.strip() != f"{target.arch}: ok":
        raise Failure(f"this machine cannot run {target.name} programs "
                      f"({(proc.stdout + proc.stderr).strip()}); run: {fix}")


def build_rootfs(work: Path, house: Path, project: Path, lock: list[Path], version: str,
                 epoch: int, target: Platform) -> Path:
    """``lock``: the lock and the files it includes (wheels.lock_sources), all in its dir."""
    staged = work / "wheels"
    for sub in ("lock", "project"):
        (staged / sub).mkdir(parents=True)
    for wheel in house.glob("*.whl"):
        shutil.copy2(wheel, staged / wheel.name)
    shutil.copy2(project, staged / "project" / project.name)
    for path in lock:
        shutil.copy2(path, staged / "lock" / path.relative_to(wheels.LOCK.parent))
    pip_wheel = next(w.name for w in house.glob("pip-*.whl"))
    rootfs = work / "rootfs"
    rootfs.mkdir()
    hook = work / "customize-hook"
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    hook.write_text(recipe.hook(epoch, pip_wheel, version, wheels.LOCK.name, sorted(scripts)))
    hook.chmod(0o755)
    cmd = [shutil.which("mmdebstrap"), "--mode=unshare", "--format=directory",
           "--variant=minbase", f"--architectures={target.arch}",
           "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
           f"--include={','.join(recipe.DEBS)}",
           *(f"--dpkgopt={o}" for o in recipe.DPKG_OPTS),
           f"--customize-hook=copy-in {staged} /tmp",
           f"--customize-hook={hook}",
           recipe.SUITE, str(rootfs),
           f"deb {MIRROR} {recipe.SUITE} main", f"deb {MIRROR} {recipe.SUITE}-updates main",
           f"deb {SECURITY} {recipe.SUITE}-security main"]
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(epoch), "TMPDIR": str(work)}
    emulated = "" if target == host_arch() else ", under qemu-user"
    log(f"mmdebstrap {recipe.SUITE} for {target.name} ({', '.join(recipe.DEBS)}) with "
        f"kata-sandbox-manager {version}{emulated}")
    run(cmd, cwd=work, env=env, what=f"mmdebstrap ({target.name})")
    shutil.rmtree(staged)
    return rootfs


def installed_dists(rootfs: Path) -> list[str]:
    _, canonical = wheels._packaging()
    site = next((rootfs / recipe.VENV_DIR.lstrip("/") / "lib").glob("python3*/site-packages"))
    out = []
    for info in site.glob("*.dist-info"):
        name, version = info.name[: -len(".dist-info")].rsplit("-", 1)
        out.append(f"{canonical(name)}=={version}")
    return sorted(out)


def deb_versions(rootfs: Path) -> list[str]:
    out, name = [], None
    for line in (rootfs / "var/lib/dpkg/status").read_text().splitlines():
        if line.startswith("Package: "):
            name = line.split(" ", 1)[1]
        elif line.startswith("Version: ") and name:
            out.append(f"{name} {line.split(' ', 1)[1]}")
    return sorted(out)


def is_code(name: str, mode: int) -> bool:
    """A file that is run or loaded: executable, or a shared object by its name (package
    data that merely looks like ELF, as the demo's OCI layout blobs, is neither)."""
    return bool(mode & 0o111) or ".so" in Path(name).suffixes


def foreign_elf(rootfs: Path, target: Platform) -> list[str]:
    """Programs and libraries (ELF) built for another machine."""
    wrong = []
    for path in rootfs.rglob("*"):
        if path.is_symlink() or not path.is_file() or not is_code(path.name, path.stat().st_mode):
            continue
        with open(path, "rb") as f:
            head = f.read(20)
        if head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") != target.elf_machine:
            wrong.append(str(path.relative_to(rootfs)))
    return wrong


def image_config(target: Platform, epoch: int, container: dict, history: str) -> dict:
    created = datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {**target.oci(), "created": created, "config": container,
            "history": [{"created": created, "created_by": history}]}


def save_part(dest: Path, kind: str, target: Platform, layer: oci.Layer, config: dict,
              extra: dict) -> dict:
    """An image's blobs in dest/blobs (the layer is there already) and part.json."""
    manifest, config_blob = oci.image(layer, config)
    for blob in (manifest, config_blob):
        (dest / "blobs" / blob.digest.split(":", 1)[1]).write_bytes(blob.data)
    info = {"kind": kind, "arch": target.arch, "platform": target.oci(),
            "manifest": manifest.descriptor(), "config": config_blob.descriptor(),
            "layer": {"digest": layer.digest, "size": layer.size, "diff_id": layer.diff_id,
                      "unpacked": layer.unpacked, "files": layer.entries}, **extra}
    (dest / "part.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def build_chart_part(dest: Path, work: Path, target: Platform, request: dict,
                     project: Path) -> None:
    """recipe.py carried out for ``target`` in ``work``, the image into ``dest`` (both new
    dirs)."""
    started = time.monotonic()
    version, epoch = request["version"], request["epoch"]
    # The lock names every file the image may install: it must pin what .venv has (else it
    # is stale: nothing is fetched), and every wheel fetched, or cached before, must be a
    # file it allows (else the index served another one).
    pins = wheels.read_lock()
    wheels.check_frozen(request["frozen"][target.arch], pins, target)
    house = wheels.wheelhouse(request["frozen"][target.arch], request["pip"], target,
                              cache_root(), log,
                              check=lambda fetched: wheels.check_wheels(fetched, pins, target))
    wheels.check_wheels(house, pins, target)
    rootfs = build_rootfs(work, house, project, wheels.lock_sources(pins), version, epoch,
                          target)
    want = sorted([*request["frozen"][target.arch], f"kata-sandbox-manager=={version}"])
    got = installed_dists(rootfs)
    if got != want:
        raise Failure(f"the {target.name} image's virtualenv differs from .venv's runtime "
                      f"closure:\n  only in the image: {sorted(set(got) - set(want))}\n"
                      f"  only in .venv: {sorted(set(want) - set(got))}")
    wrong = foreign_elf(rootfs, target)
    if wrong:
        raise Failure(f"the {target.name} image holds ELF files of another machine: "
                      + ", ".join(wrong[:10]))
    (dest / "blobs").mkdir()
    layer = oci.write_layer(rootfs, dest / "blobs", epoch, skip=recipe.layer_skip)
    packages = deb_versions(rootfs) + got
    remove_tree(rootfs)
    (dest / "packages.txt").write_text("\n".join(packages) + "\n")
    config = image_config(target, epoch, recipe.container_config(version), recipe.history(version))
    seconds = round(time.monotonic() - started)
    save_part(dest, "chart", target, layer, config, {"seconds": seconds})
    log(f"built the chart's image for {target.name} ({layer.unpacked / 2**20:.0f} MiB, "
        f"{layer.entries} files; {layer.size / 2**20:.0f} MiB gzip'd) in {seconds} s")


def build_pause_part(dest: Path, target: Platform, request: dict) -> None:
    started = time.monotonic()
    root = dest / "pause-root"
    root.mkdir()
    version = PAUSE_REF.rsplit(":", 1)[1]
    env = {**os.environ, "CGO_ENABLED": "0", "GOOS": "linux", "GOARCH": target.arch,
           "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod"}
    # -buildvcs=false: Go would stamp the checkout's revision and whether it has untracked
    # files into the binary, so a test run that leaves a file behind changed the pause image.
    run([go_binary(), "build", "-trimpath", "-buildvcs=false", "-ldflags",
         f"-s -w -buildid= -X main.version={version}", "-o", str(root / "pause"), "."],
        cwd=HERE / "pause", env=env, what="go build (pause)")
    os.chmod(root / "pause", 0o755)
    (dest / "blobs").mkdir()
    layer = oci.write_layer(root, dest / "blobs", request["epoch"])
    shutil.rmtree(root)
    config = image_config(target, request["epoch"],
                          {"User": "65535:65535", "Entrypoint": ["/pause"]},
                          f"{PROG}: hack/image/pause built with {request['go']}")
    seconds = round(time.monotonic() - started, 1)
    save_part(dest, "pause", target, layer, config, {"seconds": seconds})
    log(f"built {PAUSE_REF} for {target.name} ({layer.unpacked / 2**20:.1f} MiB) in {seconds} s")


class Part:
    """A built image in the cache: part.json and its blobs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.info = json.loads((path / "part.json").read_text())

    def blob(self, media_type: str, descriptor: dict) -> oci.Blob:
        return oci.Blob(media_type, descriptor["digest"], descriptor["size"],
                        path=self.path / "blobs" / descriptor["digest"].split(":", 1)[1])

    @property
    def manifest(self) -> oci.Blob:
        return self.blob(oci.MEDIA_MANIFEST, self.info["manifest"])

    @property
    def blobs(self) -> list[oci.Blob]:
        return [self.manifest, self.blob(oci.MEDIA_CONFIG, self.info["config"]),
                self.blob(oci.MEDIA_LAYER, self.info["layer"])]

    def summary(self) -> dict:
        return {"arch": self.info["arch"], "manifest": self.info["manifest"]["digest"],
                "config": self.info["config"]["digest"], **{
                    k: self.info["layer"][k] for k in ("unpacked", "files")},
                "layer": self.info["layer"]["digest"], "compressed": self.info["layer"]["size"],
                "build_seconds": self.info["seconds"]}
