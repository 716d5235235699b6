"""The images hack/image/build makes without Docker (the chart's image for this machine and
a pause image), imported into a real containerd and run there. The arm64 image, the
release's index, reproducibility and publishing: test_image_release.py.

The build is cached (~/.cache/kata-sandbox-manager/images), so after .ci/run's own call,
or any earlier one with the same inputs, these tests take seconds; a cold build takes
minutes."""

from __future__ import annotations

import json
import struct
import tarfile
import time
import tomllib
from pathlib import Path

import pytest
from support.chartkit import CHART, load_helm, pod_containers, render, workloads
from support.paths import REPO, require_binary

pytestmark = pytest.mark.integration

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def test_the_image_is_the_one_the_chart_runs_by_default(images):
    helm = load_helm()
    with helm.Chart.load(CHART) as chart:
        rendered = render(chart, {})
    used = {c["image"] for w in workloads(rendered) for c in pod_containers(w)}
    assert used == {images.chart_ref}
    assert images.pause_ref == "registry.k8s.io/pause:3.10.1"


def test_a_cached_call_prints_the_same_archives_without_building(images, run_build):
    # --cached-only never builds: it exits 3 where the inputs have no cached images.
    proc = run_build("--cached-only", *images.args, timeout=60)
    if proc.returncode == 3:  # only where someone edits the tree while the tests run
        pytest.skip("the image's inputs changed since this session built it")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == images.stdout
    assert proc.stderr == ""


def test_the_archives_are_oci_layouts_naming_their_images(images, chart_archive):
    (entry,) = chart_archive.layout["manifests"]
    assert entry["annotations"] == {"org.opencontainers.image.ref.name": images.chart_ref,
                                    "io.containerd.image.name": images.chart_ref}
    # An image index, as the release publishes, of this machine's image alone.
    assert entry["mediaType"] == "application/vnd.oci.image.index.v1+json"
    (image,) = chart_archive.images
    assert image.platform == {"architecture": "amd64", "os": "linux"}
    assert image.manifest["layers"][0]["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
    assert (image.config["architecture"], image.config["os"]) == ("amd64", "linux")
    assert len(image.config["rootfs"]["diff_ids"]) == 1
    with tarfile.open(images.archives[images.chart_ref]) as tar:
        assert json.loads(tar.extractfile("oci-layout").read()) == {"imageLayoutVersion": "1.0.0"}
    # What hack/image/recipe.py sets.
    container = image.config["config"]
    assert container["Entrypoint"] == ["katamgr"]
    env = dict(e.split("=", 1) for e in container["Env"])
    assert env["PATH"].split(":")[0] == "/opt/kata-sandbox-manager/bin"
    assert env["PYTHONUNBUFFERED"] == "1" and env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert container["Labels"] == {
        "org.opencontainers.image.title": "kata-sandbox-manager",
        "org.opencontainers.image.description":
            "Kata Containers with VFIO GPU passthrough for Kubernetes GPU nodes",
        "org.opencontainers.image.licenses": "Apache-2.0",
        "org.opencontainers.image.version": VERSION,
    }


def test_the_layer_is_deterministic_and_slim(images, chart_archive):
    members = chart_archive.members(chart_archive.images[0])
    epoch = images.build_info["inputs"]["epoch"]
    names = [m.name for m in members]
    # Depth first, each directory before its contents, siblings by name.
    assert names == sorted(names, key=lambda n: n.split("/"))
    assert len(set(names)) == len(names)
    assert max(m.mtime for m in members) == epoch
    assert all(m.uname == "" and m.gname == "" for m in members)
    assert not [n for n in names if n.startswith(("var/lib/apt/lists/", "usr/share/man/",
                                                  "dev/", "proc/", "sys/", "tmp/", "run/"))]
    assert not [n for n in names if n.startswith("usr/share/doc/") and n.count("/") > 3
                and not n.endswith("/copyright")]
    assert "etc/resolv.conf" not in names and "etc/hostname" not in names
    assert not [m.name for m in members if m.ischr() or m.isblk()]
    site = "opt/kata-sandbox-manager/lib/python3.11/site-packages/"
    assert f"{site}katamgr/cli.py" in names
    # A regular install of the wheel, not an editable one.
    assert not [n for n in names if n.startswith(site) and "__editable__" in n]
    # pip ran from its wheel: the virtualenv has none.
    assert not [n for n in names if n.startswith(site + "pip/")]


def python_dists(images, arch: str) -> set[str]:
    """`name==version` of every distribution in an image's virtualenv (the build's
    packages-<arch>.txt, beside the archives)."""
    listed = images.archives[images.chart_ref].parent / f"packages-{arch}.txt"
    return {line for line in listed.read_text().splitlines() if "==" in line}


def locked(hack_image, arch: str) -> set[str]:
    wheels, recipe = hack_image("wheels"), hack_image("recipe")
    return {f"{p.name}=={p.version}" for p in wheels.read_lock().values()
            if p.applies(recipe.PLATFORMS[arch])}


def test_the_virtualenv_holds_the_locked_versions_and_nothing_else(images, hack_image):
    """Every distribution is one requirements/image.lock pins (installed by its hash), and
    the package: no other, and not pip."""
    for platform in images.build_info["images"][0]["platforms"]:
        arch = platform["arch"]
        assert python_dists(images, arch) == {*locked(hack_image, arch),
                                              f"kata-sandbox-manager=={VERSION}"}


def pyc_headers(archive) -> tuple[dict[str, tuple[int, int, int]], dict[str, tarfile.TarInfo]]:
    """For every .pyc in the chart image's layer: (flags, source mtime, source size) from its
    header; and the layer's members by name."""
    (image,) = archive.images
    members = {m.name: m for m in archive.members(image)}
    headers = {}
    for name, (_, content) in archive.files(image, lambda m: m.name.endswith(".pyc")).items():
        headers[name] = struct.unpack("<III", content[4:16])
    return headers, members


def test_no_pyc_is_stale_after_the_mtime_clamp(chart_archive):
    """A .pyc whose source's mtime the layer changed would be recompiled in memory at every
    start: the virtualenv's are hash-based, Debian's match their (clamped) sources."""
    headers, members = pyc_headers(chart_archive)
    assert len(headers) > 1000
    stale, timestamped_venv = [], []
    for name, (flags, mtime, size) in headers.items():
        if flags & 1:  # hash-based
            continue
        if name.startswith("opt/"):
            timestamped_venv.append(name)
        directory, _, file = name.rpartition("/__pycache__/")
        source = members.get(f"{directory}/{file.split('.')[0]}.py")
        if source is not None and (source.mtime, source.size) != (mtime, size):
            stale.append(name)
    assert stale == []
    assert timestamped_venv == []


def test_both_images_import_into_containerd(images, containerd):
    listed = containerd.ctr("images", "ls", "-q").stdout.split()
    assert images.chart_ref in listed and images.pause_ref in listed


def test_katamgr_runs_in_the_image(images, containerd):
    proc = containerd.run(images.chart_ref, "katamgr", "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"katamgr {VERSION}"


def test_the_device_plugin_runs_in_the_image(images, containerd):
    proc = containerd.run(images.chart_ref, "sandbox-device-plugin", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: sandbox-device-plugin")


def test_the_entrypoint_is_katamgr(images, containerd):
    proc = containerd.run(images.chart_ref)  # no command: the image's entrypoint, no args
    assert proc.returncode == 2
    assert "usage: katamgr" in proc.stdout + proc.stderr


def test_the_image_has_the_host_tools_the_agent_calls(images, containerd):
    script = ("modprobe --version >/dev/null && test -s /usr/share/misc/pci.ids"
              " && python3 -c 'import pyudev; pyudev.Context()'"
              " && test -d /etc/ssl/certs && echo ok")
    proc = containerd.run(images.chart_ref, "sh", "-c", script)
    assert (proc.returncode, proc.stdout.strip()) == (0, "ok"), proc.stderr


def test_pause_exits_0_on_sigterm_within_2_s(images, containerd):
    name = containerd.new_id()
    run = containerd.popen("run", "--rm", "--snapshotter", containerd.snapshotter,
                           images.pause_ref, name)
    try:
        containerd.task_pid(name)
        started = time.monotonic()
        containerd.ctr("task", "kill", "--signal", "SIGTERM", name)
        code = run.wait(timeout=2)
        took = time.monotonic() - started
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(timeout=10)
    assert code == 0, run.stderr.read()
    assert took < 2


def children(pid: int) -> dict[int, str]:
    """pid -> state of every process whose parent is ``pid``."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid:
            out[int(entry.name)] = state
    return out


def test_pause_reaps_the_orphans_it_inherits(images, containerd):
    busybox = Path(require_binary("busybox")).resolve()
    if b"ld-linux" in busybox.read_bytes()[:4096]:
        pytest.skip(f"{busybox} is not static (install busybox-static)")
    name = containerd.new_id()
    containerd.ctr("run", "-d", "--snapshotter", containerd.snapshotter, "--mount",
                   f"type=bind,src={busybox},dst=/busybox,options=rbind:ro",
                   images.pause_ref, name)
    try:
        pause = containerd.task_pid(name)
        # The shell exits at once; its two sleeps are re-parented to the namespace's init.
        # (Without their own stdio, ctr does not wait for them.)
        sleep = "/busybox sleep 2 </dev/null >/dev/null 2>&1 &"
        containerd.ctr("task", "exec", "--exec-id", "orphans", name, "/busybox", "sh", "-c",
                       f"{sleep} {sleep} exit 0")
        assert len(children(pause)) == 2
        deadline = time.monotonic() + 6
        while children(pause) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert children(pause) == {}, "pause left zombies"
    finally:
        containerd.ctr("task", "kill", "--signal", "SIGKILL", name, check=False)
        deadline = time.monotonic() + 10
        while (containerd.ctr("task", "delete", name, check=False).returncode
               and time.monotonic() < deadline):
            time.sleep(0.2)
        containerd.ctr("containers", "delete", name, check=False)


def test_pause_is_a_static_binary_running_as_nobody(pause_archive):
    (image,) = pause_archive.images
    ((member, binary),) = pause_archive.files(image, lambda m: True).values()
    assert image.config["config"] == {"Entrypoint": ["/pause"], "User": "65535:65535"}
    assert member.name == "pause" and member.mode == 0o755
    assert b"ld-linux" not in binary[:4096]


def test_pause_says_its_version(images, containerd):
    proc = containerd.run(images.pause_ref, "/pause", "-v")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:2] == ["pause", images.pause_ref.rsplit(":", 1)[1]]


def test_a_kubectl_debug_look_plans_a_read_only_host(images, containerd, tmp_path):
    """What docs/operating.md's `kubectl debug node/<node> --image <this image> -- katamgr plan
    --host-root /host` does: the node's / at /host (here a simulated node's, bind-mounted
    read-only, so any write would fail with EROFS), katamgr found on the image's PATH."""
    from nodesim.materialise import materialise
    from nodesim.profiles import find_profile

    root = materialise(find_profile("a10-server"), tmp_path / "node").root
    mount = f"type=bind,src={root},dst=/host,options=rbind:ro"
    proc = containerd.run(images.chart_ref, "katamgr", "plan", "--host-root", "/host",
                          options=("--mount", mount))
    assert proc.returncode == 0, proc.stderr
    assert "nvidia.com/GA102GL_A10: 4" in proc.stdout
    assert "Host root: /host" in proc.stdout
