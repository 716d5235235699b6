"""The image a release publishes: `hack/image/build --arch all` (amd64 and arm64 from the one
recipe, hack/image/recipe.py, in one OCI image index), reproducible, and pushed to a real
registry by the command docs/testing.md gives.

arm64 (NVIDIA Grace) is built here under qemu-user and never run here beyond the build's own
`--help` of each command: these tests read its files. ELF facts: the System V ABI's ELF
header (e_ident class and data at bytes 4 and 5, e_machine at 18: 62 EM_X86_64, 183
EM_AARCH64, from elf.h)."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess

import pytest
from support.paths import require_binary
from support.registry_server import TEST_PASSWORD, TEST_USER, run_registry

pytestmark = pytest.mark.integration

EM = {"amd64": (62, "x86_64"), "arm64": (183, "aarch64")}
ELF_MAGIC = b"\x7fELF"


def elf_machine(head: bytes) -> int | None:
    """e_machine of a little-endian 64-bit ELF file's header, or None if not one."""
    if head[:4] != ELF_MAGIC:
        return None
    assert (head[4], head[5]) == (2, 1), "not a 64-bit little-endian ELF file"
    return int.from_bytes(head[18:20], "little")


def test_the_release_indexes_an_amd64_and_an_arm64_image(release, release_archive):
    (entry,) = release_archive.layout["manifests"]
    assert entry["mediaType"] == "application/vnd.oci.image.index.v1+json"
    assert entry["annotations"]["io.containerd.image.name"] == release.chart_ref
    assert [m["platform"] for m in release_archive.top["manifests"]] == [
        {"architecture": "amd64", "os": "linux"},
        {"architecture": "arm64", "os": "linux", "variant": "v8"}]
    for image in release_archive.images:
        assert {k: image.config.get(k) for k in ("architecture", "os", "variant")} == {
            "variant": None, **image.platform}
    info = release.build_info["images"][0]
    assert info["index"] == entry["digest"]
    assert [p["arch"] for p in info["platforms"]] == ["amd64", "arm64"]


def test_both_architectures_are_one_recipe(release, release_archive):
    amd64, arm64 = release_archive.images
    # The same container settings and history, the same Python distributions at the same
    # versions, the same Debian packages (a version may differ only by a binNMU, +bN).
    assert amd64.config["config"] == arm64.config["config"]
    assert amd64.config["history"] == arm64.config["history"]
    assert amd64.config["created"] == arm64.config["created"]
    out = release.archives[release.chart_ref].parent
    listed = {arch: (out / f"packages-{arch}.txt").read_text().splitlines()
              for arch in ("amd64", "arm64")}
    dists = {arch: [line for line in lines if "==" in line] for arch, lines in listed.items()}
    assert dists["amd64"] == dists["arm64"]
    assert "kata-sandbox-manager==" + release.chart_ref.rsplit(":", 1)[1] in dists["arm64"]

    def debs(lines):
        return [re.sub(r"\+b\d+$", "", line) for line in lines if "==" not in line]

    assert debs(listed["amd64"]) == debs(listed["arm64"])


@pytest.mark.parametrize("arch", ["amd64", "arm64"])
def test_each_architecture_holds_the_locked_versions(release, hack_image, arch):
    """requirements/image.lock's pins for the architecture, each installed by its hash, and
    the package: the same list test_lock.py holds .venv to."""
    listed = release.archives[release.chart_ref].parent / f"packages-{arch}.txt"
    dists = {line for line in listed.read_text().splitlines() if "==" in line}
    wheels, recipe = hack_image("wheels"), hack_image("recipe")
    pins = {f"{p.name}=={p.version}" for p in wheels.read_lock().values()
            if p.applies(recipe.PLATFORMS[arch])}
    assert dists == {*pins, "kata-sandbox-manager==" + release.chart_ref.rsplit(":", 1)[1]}


def test_this_machines_image_is_the_releases(images, release, chart_archive, release_archive):
    """`hack/image/build` (what the local node runs) and `--arch all` (what is published)
    hold the very same amd64 image: one manifest digest, whatever else was asked."""
    (own,) = chart_archive.images
    assert own.manifest_digest == release_archive.image("amd64").manifest_digest


def test_containerd_runs_its_own_architecture_out_of_the_release(release, release_archive,
                                                                 containerd):
    """A node given the release (as by a pull of the published tag) holds the index and
    starts this machine's image from it."""
    archive = release.archives[release.chart_ref]
    containerd.ctr("images", "import", "--snapshotter", containerd.snapshotter, str(archive),
                   timeout=300)
    listed = {line.split()[0]: line.split() for line in
              containerd.ctr("images", "ls").stdout.splitlines()[1:]}
    ref, kind, digest, *_ = listed[release.chart_ref]
    (entry,) = release_archive.layout["manifests"]
    assert (kind, digest) == ("application/vnd.oci.image.index.v1+json", entry["digest"])
    assert "linux/amd64,linux/arm64/v8" in listed[release.chart_ref]
    proc = containerd.run(release.chart_ref, "sh", "-c", "uname -m; katamgr --version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[0] == "x86_64"
    assert proc.stdout.split("\n")[1].startswith("katamgr ")


@pytest.mark.parametrize("arch", ["amd64", "arm64"])
def test_every_binary_is_built_for_its_architecture(release_archive, arch):
    machine, triplet = EM[arch]
    image = release_archive.image(arch)
    # What is run or loaded: executables, and shared objects by name (package data that
    # only looks like ELF, as the demo's OCI layout blobs, is neither).
    heads = {name: content[:20] for name, (_, content) in release_archive.files(
        image, lambda m: m.size >= 20 and (m.mode & 0o111 or ".so" in m.name.split("/")[-1]))
        .items()}
    elf = {name: elf_machine(head) for name, head in heads.items() if head[:4] == ELF_MAGIC}
    assert {name: m for name, m in elf.items() if m != machine} == {}
    site = "opt/kata-sandbox-manager/lib/python3.11/site-packages/"
    for must in ("usr/bin/python3.11", "usr/bin/kmod", f"usr/lib/{triplet}-linux-gnu/libc.so.6",
                 f"usr/lib/{triplet}-linux-gnu/libudev.so.1.7.5"):
        assert must in elf, f"{must} is not an ELF file of the {arch} image"
    extensions = [n for n in elf if n.startswith(site) and ".cpython-311-" in n]
    assert any(n.startswith(site + "pydantic_core/") for n in extensions)
    # Every compiled extension of the virtualenv is named for the architecture, as CPython
    # looks them up (EXT_SUFFIX).
    assert [n for n in extensions if not n.endswith(f".cpython-311-{triplet}-linux-gnu.so")] == []


@pytest.mark.parametrize("arch", ["amd64", "arm64"])
def test_every_wheel_installed_is_for_its_architecture(release_archive, arch):
    _, triplet = EM[arch]
    image = release_archive.image(arch)
    wheels = release_archive.files(image, lambda m: m.name.endswith(".dist-info/WHEEL"))
    assert len(wheels) > 30
    tags = {name.split("/")[-2]: [line.split(": ", 1)[1] for line in content.decode().splitlines()
                                  if line.startswith("Tag: ")]
            for name, (_, content) in wheels.items()}
    platform = {dist: t for dist, t in tags.items() if not all(tag.endswith("-any") for tag in t)}
    assert platform, "no platform wheel at all"
    assert {dist: t for dist, t in platform.items()
            if not all(tag.endswith(f"_{triplet}") for tag in t)} == {}
    # For bookworm's glibc 2.36: no manylinux tag newer.
    newest = max(int(m) for t in platform.values() for tag in t
                 for m in re.findall(r"manylinux_2_(\d+)_", tag))
    assert newest <= 36


def test_the_build_is_reproducible(images, run_build):
    """The same inputs built a second time, from scratch (caching nothing), give the same
    layer, config and manifest digests, byte for byte, for the chart's image and pause."""
    proc = run_build("--check-reproducible", *images.args)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    info = images.build_info
    expected = [f"{images.chart_ref} linux/{p['arch']} {p['manifest']} reproduced"
                for p in info["images"][0]["platforms"]]
    expected.append(f"{images.pause_ref} linux/{info['images'][1]['arch']} "
                    f"{info['images'][1]['manifest']} reproduced")
    assert proc.stdout.splitlines() == expected


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    require_binary("docker-registry")
    with run_registry(tmp_path_factory.mktemp("registry"),
                      users={TEST_USER: TEST_PASSWORD}) as running:
        yield running


def skopeo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([require_binary("skopeo"), *args], capture_output=True,  # noqa: S603
                          text=True, timeout=600)


def test_skopeo_publishes_the_release_with_its_digests(release, release_archive, registry):
    """The documented publish command (docs/testing.md), against a real registry (basic
    auth, plain HTTP here): the index and both images arrive under their own digests, so
    a node pulling the tag gets the image these tests checked."""
    archive = release.archives[release.chart_ref]
    dest = f"docker://{registry.host}/kata-sandbox-manager/kata-sandbox-manager:" \
           + release.chart_ref.rsplit(":", 1)[1]
    creds = f"{TEST_USER}:{TEST_PASSWORD}"
    proc = skopeo("copy", "--all", "--preserve-digests", "--dest-tls-verify=false",
                  "--dest-creds", creds, f"oci-archive:{archive}", dest)
    assert proc.returncode == 0, proc.stderr
    raw = skopeo("inspect", "--raw", "--tls-verify=false", "--creds", creds, dest)
    assert raw.returncode == 0, raw.stderr
    (entry,) = release_archive.layout["manifests"]
    assert "sha256:" + hashlib.sha256(raw.stdout.encode()).hexdigest() == entry["digest"]
    repository = dest.rsplit(":", 1)[0]
    for image in release_archive.images:
        # Each manifest is there under its digest ...
        manifest = skopeo("inspect", "--raw", "--tls-verify=false", "--creds", creds,
                          f"{repository}@{image.manifest_digest}")
        assert manifest.returncode == 0, manifest.stderr
        assert "sha256:" + hashlib.sha256(manifest.stdout.encode()).hexdigest() == \
            image.manifest_digest
        # ... and is what a client of that platform gets for the tag.
        platform = ["--override-arch", image.platform["architecture"]]
        if "variant" in image.platform:
            platform += ["--override-variant", image.platform["variant"]]
        config = skopeo(*platform, "inspect", "--config", "--raw", "--tls-verify=false",
                        "--creds", creds, dest)
        assert config.returncode == 0, config.stderr
        assert "sha256:" + hashlib.sha256(config.stdout.encode()).hexdigest() == \
            image.manifest["config"]["digest"]
        assert json.loads(config.stdout)["architecture"] == image.platform["architecture"]
