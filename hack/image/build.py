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
import json
import os
import shutil
import signal
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV = HERE.parents[1] / ".venv"
VENV_PYTHON = VENV / "bin" / "python"
# importlib.metadata must read .venv's distributions: run under its Python (hack/image/build
# starts it so; this is for a direct run).
if VENV_PYTHON.exists() and Path(sys.prefix).resolve() != VENV.resolve():
    os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), str(Path(__file__)), *sys.argv[1:]])

sys.path.insert(0, str(HERE))
# hack/image's modules, after the re-exec: buildenv (where, the log, commands), buildinputs
# (what keys the cache), buildcache, buildparts (one architecture's image), buildrequest.
from buildcache import prune  # noqa: E402
from buildenv import PROG, log  # noqa: E402
from buildinputs import chart_ref, parse_arches  # noqa: E402
from buildrequest import Request, check_reproducible  # noqa: E402
from wheels import Failure  # noqa: E402


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
