"""Working with kata-deploy: on a node where kata-deploy installed Kata and registered a runtime
class katamgr is configured for, katamgr pulls nothing for that class, registers nothing in
containerd for it, and writes only its GPU settings as a drop-in beside kata-deploy's config
(``kataDeploy``: auto by default); ``katamgr revert`` takes the drop-in away and nothing else."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import tomlkit
from support.kataconfig import LAYOUT_ON_NODE, kata_manager_yaml, prepare_node
from support.nodecontextkit import katamgr_context

from gpunode.host.pciids import PciIds
from gpunode.kataclasses import GPU, GPU_SNP
from gpunode.policy.naming import Naming
from katamgr.config import parse_config
from katamgr.pipeline.kata_runtime import KataContext, class_dir
from katamgr.pipeline.reconcile import Steps, full_plan, reconcile, revert_all
from nodesim.katadeploy import KataInstall
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

NAMING = Naming(PciIds.find())
CONFIG_D = "/opt/kata/share/defaults/kata-containers/runtimes/{shim}/config.d/90-kata-sandbox-manager.toml"


def kata_deploy_node(tmp_path: Path, release: str = "3.29.0"):
    profile = dataclasses.replace(find_profile("dgx-h100"), kata=KataInstall("kata-deploy", release, ("go",)))
    return prepare_node(materialise(profile, tmp_path / "root"), containerd=False)


def files_under(host, directory: str) -> dict[str, bytes]:
    base = host.path(directory)
    return {str(p.relative_to(base)): p.read_bytes() for p in sorted(base.rglob("*")) if p.is_file()}


def setup(tmp_path, extra: str = "", classes=(GPU, GPU_SNP), release: str = "3.29.0"):
    host = kata_deploy_node(tmp_path, release)
    config = parse_config(kata_manager_yaml(classes) + extra)
    return host, config, katamgr_context(host, config)


def test_kata_deploy_s_classes_get_only_the_gpu_settings(tmp_path):
    host, config, node = setup(tmp_path)
    naming = node.naming
    before = files_under(host, "/opt/kata")
    kata_deploy_drop_in = host.path("/opt/kata/containerd/config.d/kata-deploy.toml").read_bytes()

    plan = full_plan(host, naming, Steps(), KataContext(config), kata_found=node.kata_found)
    artifacts = {a["runtimeClass"]: a for a in next(s for s in plan.sections if s.key == "artifacts").data}
    assert {a["action"] for a in artifacts.values()} == {"kata-deploy"}
    assert artifacts[GPU]["dropIn"] == CONFIG_D.format(shim="qemu-nvidia-gpu")
    assert next(s for s in plan.sections if s.key == "containerd").data["pendingArtifacts"] == []

    report = reconcile(host, naming, Steps(), KataContext(config), kata_found=node.kata_found)
    assert report.ok, report.failures
    # Nothing pulled, nothing of katamgr's registered for these classes in containerd.
    assert not host.path(class_dir(config, GPU)).exists()
    assert not host.path(class_dir(config, GPU_SNP)).exists()
    assert host.path("/opt/kata/containerd/config.d/kata-deploy.toml").read_bytes() == kata_deploy_drop_in
    for shim in ("qemu-nvidia-gpu", "qemu-nvidia-gpu-snp"):
        drop_in = tomlkit.parse(host.path(CONFIG_D.format(shim=shim)).read_text())
        # dgx-h100: 8 GPUs passed through (its NVSwitches stay home under Kata 3.29).
        assert drop_in["hypervisor"]["qemu"]["pcie_root_port"] == 8
        assert drop_in["runtime"]["pod_resource_device_sources"] == ["device-plugin"]
    assert not host.path(CONFIG_D.format(shim="qemu-nvidia-gpu-tdx")).exists()  # not configured
    after = files_under(host, "/opt/kata")
    ours = {k for k in after if k.endswith("90-kata-sandbox-manager.toml")}
    assert {k: v for k, v in after.items() if k not in ours} == before  # kata-deploy's files as they were

    again = reconcile(host, naming, Steps(), KataContext(config), kata_found=node.kata_found)
    assert again.ok and not [c for c in again.changes if "kata-sandbox-manager.toml" in c]

    undone = revert_all(host, Steps(), KataContext(config))
    assert undone.ok, undone.failures
    assert files_under(host, "/opt/kata") == before


def test_kata_deploy_false_pulls_katamgr_s_own(tmp_path):
    host, config, node = setup(tmp_path, "kataDeploy: false\n", classes=(GPU,))
    naming = node.naming
    assert host.path(LAYOUT_ON_NODE).is_dir()
    report = reconcile(host, naming, Steps(), KataContext(config), kata_found=node.kata_found)
    assert report.ok, report.failures
    assert host.path(class_dir(config, GPU)).is_dir()
    assert not host.path(CONFIG_D.format(shim="qemu-nvidia-gpu")).exists()


def test_kata_deploy_true_refuses_a_class_kata_deploy_does_not_provide(tmp_path):
    host, config, node = setup(tmp_path, "kataDeploy: true\n", classes=(GPU, "kata-qemu-nvidia-gpu-custom"))
    naming = node.naming
    report = reconcile(host, naming, Steps(), KataContext(config), kata_found=node.kata_found)
    # That class alone fails, by name; kata-deploy's own class gets its GPU settings all the same.
    assert report.partly and list(report.classes_failed) == ["kata-qemu-nvidia-gpu-custom"]
    assert ("kataDeploy is true but kata-deploy registered no runtime kata-qemu-nvidia-gpu-custom on this node"
            in report.classes_failed["kata-qemu-nvidia-gpu-custom"])
    assert report.classes_ready == [GPU]
    assert host.path(CONFIG_D.format(shim="qemu-nvidia-gpu")).exists()


def test_kata_deploy_under_another_installation_prefix_serves_its_classes(tmp_path):
    """kata-deploy's INSTALLATION_PREFIX (its config.rs: the install dir is <prefix>/opt/kata)
    puts every path it registers below the prefix. The runtime detection finds is kata-deploy's
    wherever it lies: with kataDeploy true its class gets the GPU settings beside its config
    (not a refusal), and revert takes them away again."""
    host = kata_deploy_node(tmp_path)
    prefix = "/usr/local"
    moved = host.path(prefix + "/opt/kata")
    moved.parent.mkdir(parents=True, exist_ok=True)
    host.path("/opt/kata").rename(moved)
    drop_in = moved / "containerd/config.d/kata-deploy.toml"
    drop_in.write_text(drop_in.read_text().replace('"/opt/kata/', f'"{prefix}/opt/kata/'))
    main = host.path("/etc/containerd/config.toml")
    main.write_text(main.read_text().replace('"/opt/kata/', f'"{prefix}/opt/kata/'))
    before = files_under(host, prefix + "/opt/kata")
    config = parse_config(kata_manager_yaml((GPU,)) + "kataDeploy: true\n")
    node = katamgr_context(host, config)
    naming = node.naming
    found = {r.name: r for r in node.kata_found.runtimes}
    assert found[GPU].installed_by == "kata-deploy" and found[GPU].config_path.startswith(prefix + "/opt/kata/")

    report = reconcile(host, naming, Steps(), KataContext(config), kata_found=node.kata_found)
    assert report.ok, report.failures
    assert report.classes_ready == [GPU]
    assert not host.path(class_dir(config, GPU)).exists()  # nothing pulled
    ours = host.path(prefix + CONFIG_D.format(shim="qemu-nvidia-gpu"))
    assert tomlkit.parse(ours.read_text())["hypervisor"]["qemu"]["pcie_root_port"] == 8

    undone = revert_all(host, Steps(), KataContext(config))
    assert undone.ok, undone.failures
    assert files_under(host, prefix + "/opt/kata") == before
