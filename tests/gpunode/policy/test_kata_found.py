"""Kata found on the node (``gpunode.policy.katadetect``): the runtimes containerd registers, their
release and who installed them, on nodes laid out as kata-deploy does (``nodesim.katadeploy``),
and what the release found decides (NVSwitches, ``devices.kataVersion`` as the override)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpunode.host.pciids import PciIds
from gpunode.host.root import HostRoot
from gpunode.policy import katadetect
from gpunode.policy.katarelease import KataRelease, parse_release
from gpunode.policy.naming import Naming
from gpunode.policy.selection import NvswitchRule
from katamgr.agent.events import NodeEvents
from katamgr.pipeline.plan import build_plan
from nodesim.katadeploy import (
    DROP_IN,
    V3_PLUGIN,
    KataInstall,
    drop_in,
    install_files,
    version_line,
    with_import,
)
from nodesim.materialise import materialise
from nodesim.profiles import SHIPPED, find_profile

CONTAINERD = "/etc/containerd/config.toml"
GPU_CLASSES = ("kata-qemu-nvidia-gpu", "kata-qemu-nvidia-gpu-snp")
LAYOUTS = [("3.25.0", ("go",)), ("3.29.0", ("go", "runtime-rs")), ("4.1.0", ("go", "runtime-rs"))]
NAMING = Naming(PciIds.find())
NVSWITCHES = ("0000:05:00.0", "0000:15:00.0", "0000:85:00.0", "0000:95:00.0")  # dgx-h100's


def kata_profile(release: str, shims=("go",), base: str = "dgx-h100"):
    return dataclasses.replace(find_profile(base), kata=KataInstall("kata-deploy", release, tuple(shims)))


def node(tmp_path: Path, release: str, shims=("go",), base: str = "dgx-h100") -> HostRoot:
    return materialise(kata_profile(release, shims, base), tmp_path / "root")


@pytest.mark.parametrize(("release", "shims"), LAYOUTS, ids=[r for r, _ in LAYOUTS])
def test_each_kata_deploy_layout_is_found_with_its_release(tmp_path, release, shims):
    found = katadetect.detect(node(tmp_path, release, shims), CONTAINERD)
    assert found.problems == ()
    gpu = [f"kata-qemu-nvidia-gpu{s}" for s in ("", "-snp", "-tdx")]
    names = gpu + ([f"{n}-runtime-rs" for n in gpu] if "runtime-rs" in shims else [])
    assert sorted(r.name for r in found.runtimes) == sorted(names)
    for runtime in found.runtimes:
        assert runtime.release == parse_release(release)
        assert runtime.release_from == "containerd-shim-kata-v2 --version"
        assert runtime.installed_by == katadetect.KATA_DEPLOY
        shim = runtime.name.removeprefix("kata-")
        if runtime.name.endswith("-runtime-rs"):
            assert runtime.flavour == katadetect.RUST
            assert runtime.shim == "/opt/kata/runtime-rs/bin/containerd-shim-kata-v2"
            assert runtime.config_path == (f"/opt/kata/share/defaults/kata-containers/runtime-rs/runtimes/{shim}/"
                                           f"configuration-{shim}.toml")
        else:
            assert runtime.flavour == katadetect.GO
            assert runtime.shim == "/opt/kata/bin/containerd-shim-kata-v2"
            assert runtime.config_path == (f"/opt/kata/share/defaults/kata-containers/runtimes/{shim}/"
                                           f"configuration-{shim}.toml")
    # Kata 4.x sits beside containerd 2.2, whose conf.d kata-deploy writes its drop-in into.
    where = "/etc/containerd/conf.d/kata-deploy.toml" if release.startswith("4.") else \
        "/opt/kata/containerd/config.d/kata-deploy.toml"
    assert {r.defined_in for r in found.runtimes} == {where}
    assert found.release_for(GPU_CLASSES) == parse_release(release)


def test_the_version_lines_are_kata_s_own_format():
    """The stand-in shims print what Kata's do (main.go's Printf, runtime-rs's show_version)."""
    assert katadetect.parse_shim_version(
        'Kata Containers containerd shim (Golang): id: "io.containerd.kata.v2", version: 3.29.0, commit: 1a2b3c'
    ) == (KataRelease((3, 29, 0)), katadetect.GO)
    assert katadetect.parse_shim_version(
        "Kata Containers containerd shim (Rust): id: io.containerd.kata.v2, version: 4.1.0, commit: 1a2b3c"
    ) == (KataRelease((4, 1, 0)), katadetect.RUST)
    assert katadetect.parse_shim_version(version_line("3.25.0", "go"))[0] == KataRelease((3, 25, 0))
    assert katadetect.parse_shim_version("containerd-shim-runc-v2 version 1.7") is None


def test_a_shim_that_cannot_run_leaves_the_install_s_version_file_to_answer(tmp_path):
    def broken(shim: Path) -> str:
        raise OSError(8, "Exec format error")

    found = katadetect.detect(node(tmp_path, "3.29.0"), CONTAINERD, read_version=broken)
    assert {r.release for r in found.runtimes} == {KataRelease((3, 29, 0))}
    assert all(r.release_from.startswith("/opt/kata/VERSION, as ") for r in found.runtimes)


def test_a_shim_that_hangs_is_cut_off(tmp_path):
    host = node(tmp_path, "3.29.0")
    shim = host.path("/opt/kata/bin/containerd-shim-kata-v2")
    shim.write_text("#!/bin/sh\nsleep 30\n")
    host.path("/opt/kata/VERSION").unlink()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(katadetect, "VERSION_TIMEOUT_S", 0.2)
        found = katadetect.detect(host, CONTAINERD)
    assert found.release_for() == katadetect.UNKNOWN
    assert any("timed out" in p for p in found.problems)
    # Said with the host's path, not the one this process reached it by (its host root).
    runtime = next(r for r in found.runtimes if r.name == "kata-qemu-nvidia-gpu")
    assert runtime.release_from == "/opt/kata/bin/containerd-shim-kata-v2 --version failed: timed out after 0.2 s"
    assert not [p for p in found.problems if str(host.root) in p]


def test_our_own_classes_and_a_package_s_are_told_apart(tmp_path):
    host = HostRoot.at(tmp_path)
    for path in ("/usr/local/bin/containerd-shim-kata-v2", "/usr/bin/containerd-shim-kata-qemu-v2"):
        local = host.path(path)
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(f"#!/bin/sh\necho '{version_line('3.25.0', 'go')}'\n")
        local.chmod(0o755)
    host.path(CONTAINERD).parent.mkdir(parents=True)
    host.path(CONTAINERD).write_text(
        'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kata-qemu-nvidia-gpu]\n'
        'runtime_type = "io.containerd.kata.v2"\n'
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kata-qemu-nvidia-gpu.options]\n'
        'ConfigPath = "/opt/nvidia-gpu-operator/artifacts/runtimeclasses/kata-qemu-nvidia-gpu/configuration.toml"\n'
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kata]\n'
        'runtime_type = "io.containerd.kata-qemu.v2"\n'
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kata.options]\n'
        'ConfigPath = "/usr/share/defaults/kata-containers/configuration-qemu.toml"\n'
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\nruntime_type = "io.containerd.runc.v2"\n')
    found = katadetect.detect(host, CONTAINERD, artifacts_dir="/opt/nvidia-gpu-operator/artifacts/runtimeclasses")
    by_name = {r.name: r for r in found.runtimes}
    assert sorted(by_name) == ["kata", "kata-qemu-nvidia-gpu"]
    assert by_name["kata-qemu-nvidia-gpu"].installed_by == katadetect.KATAMGR
    assert by_name["kata-qemu-nvidia-gpu"].shim == "/usr/local/bin/containerd-shim-kata-v2"
    assert by_name["kata"].installed_by == katadetect.PACKAGE
    assert by_name["kata"].shim == "/usr/bin/containerd-shim-kata-qemu-v2"


def test_kata_deploy_installed_below_containerd_s_view_of_the_node_is_found_by_its_paths(tmp_path):
    """hack/local-cluster's node: containerd sees the node's / at DIR/host (the chart's
    hostPaths.rootFS, passed as --runtime-root), so kata-deploy installed there with that
    INSTALLATION_PREFIX (its config.rs: the install dir is <prefix>/opt/kata) writes the prefix
    into every path of containerd's config; katamgr reads them back as the node's paths."""
    root = tmp_path / "host"
    host = HostRoot.at(root, runtime_root=str(root.resolve()))
    prefix = host.runtime_root
    install = KataInstall("kata-deploy", "3.29.0", ("go",))
    install_files(host, install)
    host.path(DROP_IN).parent.mkdir(parents=True)
    host.path(DROP_IN).write_text(drop_in(install, V3_PLUGIN, prefix))
    host.path(CONTAINERD).parent.mkdir(parents=True)
    host.path(CONTAINERD).write_text(with_import("version = 3\n", prefix + DROP_IN))
    found = katadetect.detect(host, CONTAINERD)
    assert found.problems == ()
    assert sorted(r.name for r in found.runtimes) == [f"kata-qemu-nvidia-gpu{s}" for s in ("", "-snp", "-tdx")]
    for runtime in found.runtimes:
        shim = runtime.name.removeprefix("kata-")
        assert (runtime.shim, runtime.config_path, runtime.defined_in, runtime.installed_by) == (
            "/opt/kata/bin/containerd-shim-kata-v2",
            f"/opt/kata/share/defaults/kata-containers/runtimes/{shim}/configuration-{shim}.toml",
            DROP_IN, katadetect.KATA_DEPLOY)
        assert (runtime.release, runtime.release_from) == (KataRelease((3, 29, 0)), "containerd-shim-kata-v2 --version")
    # Read as if containerd saw the node at /, the same config names nothing that is there.
    plain = katadetect.detect(HostRoot.at(root), CONTAINERD)
    assert plain.runtimes == ()


def test_no_containerd_config_finds_nothing(tmp_path):
    assert katadetect.detect(HostRoot.at(tmp_path), CONTAINERD) == katadetect.KataOnNode()


def test_the_release_found_decides_where_none_was_typed(tmp_path):
    found = katadetect.detect(node(tmp_path, "4.1.0"), CONTAINERD)
    chosen, found = katadetect.with_found(NvswitchRule(), found, GPU_CLASSES)
    assert chosen.kata == KataRelease((4, 1, 0)) and chosen.takes_nvswitches("auto") and found.warning == ""


def test_a_typed_release_stays_the_override_with_a_warning_and_an_event(tmp_path):
    found = katadetect.detect(node(tmp_path, "4.1.0"), CONTAINERD)
    chosen, disagreeing = katadetect.with_found(NvswitchRule(parse_release("3.29.0")), found, GPU_CLASSES)
    assert chosen.kata == KataRelease((3, 29, 0)) and not chosen.takes_nvswitches("auto")
    assert "devices.kataVersion (--kata-version) says the node runs Kata 3.29.0, but its Kata runtimes " \
           "kata-qemu-nvidia-gpu, kata-qemu-nvidia-gpu-snp, kata-qemu-nvidia-gpu-tdx are Kata 4.1.0" \
           in disagreeing.warning
    _, same = katadetect.with_found(NvswitchRule(parse_release("4.1")), found, GPU_CLASSES)
    assert same.warning == ""

    plan = build_plan(node(tmp_path / "again", "4.1.0"), dataclasses.replace(NAMING, nvswitch_rule=chosen),
                      cc_modes=False, kata_found=disagreeing)
    assert disagreeing.warning in plan.warnings

    recorded = []

    class Recorder:
        def record(self, reason, message, type_, limited):
            recorded.append((reason, type_, message))

    NodeEvents(Recorder()).nvswitches(plan.inventory, plan.kata_found.warning)
    assert ("KataVersionDisagrees", "Warning", disagreeing.warning) in recorded


@pytest.mark.parametrize(("release", "passed"), [("3.29.0", False), ("4.1.0", True)])
def test_the_nvswitch_decision_follows_the_release_found(tmp_path, release, passed):
    host = node(tmp_path, release)
    rule, found = katadetect.with_found(NvswitchRule(), katadetect.detect(host, CONTAINERD), GPU_CLASSES)
    plan = build_plan(host, dataclasses.replace(NAMING, nvswitch_rule=rule), cc_modes=False, kata_found=found)
    switches = [d for d in plan.devices if d.bdf in NVSWITCHES]
    assert len(switches) == 4
    assert all((d.action == "bind") == passed for d in switches)
    held = any("NVSwitches 0000:05:00.0" in w and "stay on their drivers" in w for w in plan.warnings)
    assert held is not passed
    section = next(s for s in plan.sections if s.key == "kata_found")
    assert section.data["deciding"] == release and section.lines[0] == f"deciding: Kata {release}"
    # The device plugin and the DRA driver find the same release (tests/plugin/test_node_kata.py).


def test_plan_shows_the_kata_found_as_text_and_json(tmp_path):
    data = yaml.safe_load((SHIPPED / "dgx-h100.yaml").read_text())
    data["kata"] = {"installed_by": "kata-deploy", "release": "3.29.0", "shims": ["go", "runtime-rs"]}
    profile = tmp_path / "dgx-kata-deploy.yaml"
    profile.write_text(yaml.safe_dump(data))
    katamgr = str(Path(sys.executable).parent / "katamgr")
    result = subprocess.run([katamgr, "plan", "--host", str(profile), "--output", "json"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)["kataFound"]
    assert found["deciding"] == found["release"] == "3.29.0"
    gpu = next(r for r in found["runtimes"] if r["name"] == "kata-qemu-nvidia-gpu-runtime-rs")
    assert gpu == {"name": "kata-qemu-nvidia-gpu-runtime-rs",
                   "shim": "/opt/kata/runtime-rs/bin/containerd-shim-kata-v2",
                   "configPath": "/opt/kata/share/defaults/kata-containers/runtime-rs/runtimes/"
                                 "qemu-nvidia-gpu-runtime-rs/configuration-qemu-nvidia-gpu-runtime-rs.toml",
                   "flavour": "runtime-rs", "release": "3.29.0",
                   "releaseFrom": "containerd-shim-kata-v2 --version", "installedBy": "kata-deploy",
                   "definedIn": "/opt/kata/containerd/config.d/kata-deploy.toml"}
    # -o wide: every line in full (the default wraps the long ones to the terminal)
    text = subprocess.run([katamgr, "plan", "--host", str(profile), "-o", "wide"], capture_output=True, text=True,
                          timeout=120)
    assert "Kata found on the node:\n  deciding: Kata 3.29.0\n  kata-qemu-nvidia-gpu: Kata 3.29.0 (go, " \
           "containerd-shim-kata-v2 --version), installed by kata-deploy" in text.stdout


def _second_install(host: HostRoot, release: str, suffix: str = "lts") -> None:
    """A second kata-deploy install beside the first, as its multiInstallSuffix lays it out
    (kata-deploy config.rs: the install dir /opt/kata-<suffix>, each runtime kata-<shim>-<suffix>)."""
    install = KataInstall("kata-deploy", release, ("go",))
    text = drop_in(install, V3_PLUGIN).replace("/opt/kata/", f"/opt/kata-{suffix}/")
    for shim in ("qemu-nvidia-gpu-snp", "qemu-nvidia-gpu-tdx", "qemu-nvidia-gpu"):
        text = text.replace(f"runtimes.kata-{shim}]", f"runtimes.kata-{shim}-{suffix}]").replace(
            f"runtimes.kata-{shim}.options]", f"runtimes.kata-{shim}-{suffix}.options]")
    host.path(f"/etc/containerd/conf.d/kata-deploy-{suffix}.toml").write_text(text)
    shim = host.path(f"/opt/kata-{suffix}/bin/containerd-shim-kata-v2")
    shim.parent.mkdir(parents=True)
    shim.write_text(f"#!/bin/sh\necho '{version_line(release, 'go')}'\n")
    shim.chmod(0o755)


def test_two_installs_are_decided_alike_by_katamgr_and_the_plugins(tmp_path):
    """Kata 4.1.0 at /opt/kata (the kata-qemu-nvidia-gpu* classes) and 3.29.0 at /opt/kata-lts
    (the -lts classes), nothing configured: the classes pods are given decide, for plan and
    apply (the agent's default classes) and for the device plugin and the DRA driver (which
    know no classes) alike, so they bind and advertise the same NVSwitches."""
    from support.nodecontextkit import katamgr_context, plugin_context

    host = node(tmp_path, "4.1.0")
    _second_install(host, "3.29.0")
    found = katadetect.detect(host, CONTAINERD)
    assert {r.name: str(r.release) for r in found.runtimes}["kata-qemu-nvidia-gpu-lts"] == "Kata 3.29.0"
    agent = katamgr_context(host).nvswitch_rule
    plugin = plugin_context(host, "--containerd-config", CONTAINERD).nvswitch_rule
    assert agent.kata == plugin.kata == KataRelease((4, 1, 0))
    assert agent.takes_nvswitches("auto") and plugin.takes_nvswitches("auto")


def test_a_profile_says_how_kata_is_laid_out():
    from nodesim.profile import ProfileError, parse_profile

    base = {"name": "n", "devices": []}
    assert parse_profile({**base, "kata": {"release": "4.1.0", "shims": ["runtime-rs"]}}).kata == \
        KataInstall("kata-deploy", "4.1.0", ("runtime-rs",))
    for bad in ({"release": "latest"}, {"release": "3.29.0", "shims": ["java"]}, {"installed_by": "apt"}):
        with pytest.raises(ProfileError):
            parse_profile({**base, "kata": bad})


def test_the_default_containerd_config_is_the_runtime_layer_s():
    from katamgr.runtime.settings import DEFAULT_CONFIG_PATH

    assert katadetect.CONTAINERD_CONFIG == DEFAULT_CONFIG_PATH
