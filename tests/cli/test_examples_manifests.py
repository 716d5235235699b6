"""The example pods and the node-labelling script users copy from the README."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from support.paths import EXAMPLES, REPO, REQUIRE_INTEGRATION

PODS = sorted((EXAMPLES / "pods").glob("*.yaml"))
KATA_POD = EXAMPLES / "pods" / "cuda-vectoradd-kata.yaml"
CONTAINER_POD = EXAMPLES / "pods" / "cuda-vectoradd-container.yaml"
LABEL_SCRIPT = EXAMPLES / "label-node.sh"
A10_HOST = EXAMPLES / "hosts" / "a10-server.yaml"
KATAMGR = REPO / ".venv" / "bin" / "katamgr"

# What the sandbox device plugin advertises for an A10 (pci.ids 10de:2236 "GA102GL [A10]").
A10_RESOURCE = "nvidia.com/GA102GL_A10"
KUBE_VERSIONS = ("1.25.0", "1.33.0")


def load(path: Path) -> dict:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert len(docs) == 1, f"{path.name} should hold one object"
    return docs[0]


def limits(pod: dict) -> dict:
    (container,) = pod["spec"]["containers"]
    return container["resources"]["limits"]


@pytest.mark.integration
@pytest.mark.parametrize("path", PODS, ids=[p.name for p in PODS])
def test_example_pods_are_valid_kubernetes_objects(path):
    try:
        import kubernetes_validate
    except ImportError as exc:
        message = f"kubernetes-validate is not installed ({exc})"
        if REQUIRE_INTEGRATION:
            pytest.fail(message)
        pytest.skip(message)
    pod = load(path)
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(pod, version, strict=True)


def test_there_is_a_kata_and_a_container_example():
    assert {KATA_POD, CONTAINER_POD} <= set(PODS)


def test_kata_pod_runs_in_a_vm_with_a_passthrough_a10():
    pod = load(KATA_POD)
    annotations = pod["metadata"]["annotations"]
    assert pod["spec"]["runtimeClassName"] == "kata-qemu-nvidia-gpu"
    assert pod["spec"]["restartPolicy"] == "OnFailure"
    # Cold-plug gives the VM the GPU the kubelet allocated; an annotation naming
    # nvidia.com/pgpu=0 would hand GPU 0 to every such pod on top of it.
    assert not [k for k in annotations if k.startswith("cdi.k8s.io/")]
    # Annotation values are strings; an unquoted number would be refused by the API server.
    assert annotations["io.katacontainers.config.hypervisor.default_memory"] == "16384"
    assert limits(pod) == {A10_RESOURCE: 1}


def test_the_kata_pod_runtime_class_is_one_the_chart_installs():
    files = [REPO / "deploy/helm/kata-sandbox-manager/values.yaml",
             *sorted((EXAMPLES / "values").glob("*.yaml"))]
    assert len(files) >= 3  # the chart's defaults, mixed-cluster, air-gapped
    runtime_class = load(KATA_POD)["spec"]["runtimeClassName"]
    checked = 0
    for path in files:
        config = (yaml.safe_load(path.read_text()).get("kataManager") or {}).get("config")
        if config is None:  # takes the chart's defaults (e.g. local-cluster.yaml)
            continue
        names = {rc["name"] for rc in config["runtimeClasses"]}
        assert runtime_class in names, path.name
        checked += 1
    assert checked >= 3, files


def test_kata_pod_requests_what_katamgr_plans_for_an_a10_host():
    result = subprocess.run(  # noqa: S603 - fixed argument list, our own command
        [str(KATAMGR), "plan", "--host", str(A10_HOST), "--output", "json"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr
    resources = json.loads(result.stdout)["resources"]
    assert set(limits(load(KATA_POD))) <= set(resources)


def test_container_pod_asks_for_an_ordinary_gpu():
    pod = load(CONTAINER_POD)
    assert "runtimeClassName" not in pod["spec"]
    assert limits(pod) == {"nvidia.com/gpu": 1}


# --- examples/label-node.sh, run against a stand-in kubectl -------------------------------

FAKE_KUBECTL = """#!/bin/sh
# Records each call; answers `get node` with the gpu.present label value it was given.
echo "$*" >> "$KUBECTL_LOG"
case "$1" in
  get) printf '%s' "$GPU_PRESENT" ;;
esac
"""


def run_label_script(tmp_path: Path, *args: str, gpu_present: str = "true"):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(FAKE_KUBECTL)
    kubectl.chmod(0o755)
    log = tmp_path / "kubectl.log"
    log.write_text("")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "KUBECTL_LOG": str(log), "GPU_PRESENT": gpu_present}
    result = subprocess.run(["bash", str(LABEL_SCRIPT), *args], env=env,  # noqa: S603
                            capture_output=True, text=True, timeout=30, check=False)
    return result, log.read_text().splitlines()


def test_label_script_marks_a_node_for_vm_passthrough(tmp_path):
    result, calls = run_label_script(tmp_path, "gpu-node-1")
    assert result.returncode == 0, result.stderr
    assert calls[-1] == "label node gpu-node-1 nvidia.com/gpu.workload.config=vm-passthrough --overwrite"
    assert not any("gpu.present=true" in call for call in calls)


def test_label_script_can_return_a_node_to_containers_and_sets_gpu_present(tmp_path):
    result, calls = run_label_script(tmp_path, "gpu-node-2", "container", gpu_present="")
    assert result.returncode == 0, result.stderr
    assert "label node gpu-node-2 nvidia.com/gpu.present=true" in calls
    assert calls[-1] == "label node gpu-node-2 nvidia.com/gpu.workload.config=container --overwrite"


def test_label_script_refuses_an_unknown_workload(tmp_path):
    result, calls = run_label_script(tmp_path, "gpu-node-1", "vm-gpu")
    assert result.returncode == 2
    assert "vm-gpu" in result.stderr
    assert calls == []
