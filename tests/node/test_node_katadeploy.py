"""Kata installed on the real node as kata-deploy installs it, and a GPU Kata pod run through
kata-deploy's containerd runtime.

kata-deploy's layout and containerd drop-in are written as its installer writes them
(tests/support/katadeploynode.py says where each fact comes from), with the prefix that puts
them where this node's containerd finds them. The agent runs with ``kataDeploy`` at its
default, ``auto`` (examples/values/local-node.yaml): a runtime class kata-deploy provides is
kata-deploy's (no artifacts pulled, only katamgr's GPU drop-in written beside its config).

What containerd does with kata-deploy's entry (containerd 2.2's internal/cri/config
GenerateRuntimeOptions): for a ``runtime_type`` other than runc's it sends the shim Kata's
options, runtimeoptions.v1.Options with the entry's ``ConfigPath``, on the sandbox's and each
container's Create. The shim is the stand-in hack/containerd/kata-shim: containerd's runc shim
taking those options (no Kata guest can start here), which answers ``--version`` as Kata's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from support.katadeploynode import KataDeployed, shim_binary
from support.kubecluster import wait_for
from support.nodekit import GPU_RESOURCE, IMAGE, KATA_CLASS, NAMESPACE, ask_kata, vm_devices

from gpunode.policy.katadetect import RELEASE_LABEL
from nodesim.katadeploy import KataInstall

PODS = "node-katadeploy"
RELEASE = "3.29.0"  # the release local-node.yaml types, so that what it decides stays the same
GO_SHIM = "/opt/kata/bin/containerd-shim-kata-v2"
CONFIG = "/opt/kata/share/defaults/kata-containers/runtimes/qemu-nvidia-gpu/configuration-qemu-nvidia-gpu.toml"
GPU_DROP_IN = "share/defaults/kata-containers/runtimes/qemu-nvidia-gpu/config.d/90-kata-sandbox-manager.toml"
RS_CLASS = "kata-qemu-nvidia-gpu-runtime-rs"


@pytest.fixture(scope="module")
def kata_deploy(node):
    shim = shim_binary()
    node.cluster.namespace(PODS)
    before = {"label": node.get()["metadata"].get("labels", {}).get(RELEASE_LABEL),
              "containerd": (node.cluster.dir / "containerd/config.toml").read_bytes(),
              "events": len(node.events("KataChanged"))}
    deployed = KataDeployed.put(node.cluster, shim, KataInstall("kata-deploy", RELEASE, ("go", "runtime-rs")))
    state = {"deployed": deployed, "installed": deployed.installed, "before": before, "removed": False}
    try:
        yield state
    finally:
        if not state["removed"]:
            _take_off(node, deployed)


def _take_off(node, deployed: KataDeployed) -> None:
    node.cluster.kubectl("delete", "pods", "--all", "-n", PODS, "--grace-period", "1", "--wait=true",
                         timeout=120, check=False)
    node.cluster.kubectl("delete", "runtimeclass", RS_CLASS, "--ignore-not-found", check=False)
    deployed.remove()


def _agent_plan(node, deployed: KataDeployed) -> dict:
    """``katamgr plan`` in the agent's container, as an operator runs it there."""
    agent = node.component_pod("sandbox-agent")["metadata"]["name"]
    result = node.cluster.kubectl(
        "exec", "-n", NAMESPACE, agent, "-c", "kata-manager", "--", "katamgr", "plan",
        "--config", "/etc/kata-sandbox-manager/config.yaml", "--host-root", "/host",
        "--runtime-root", deployed.prefix, "--output", "json", check=False, timeout=120)
    assert result.stdout, result.stderr
    return json.loads(result.stdout)


def _ctr(node, *args: str) -> str:
    c = node.cluster
    result = subprocess.run([str(c.bin / "ctr"), "--address", str(c.dir / "containerd/containerd.sock"),
                             "--namespace", "k8s.io", *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_agent_finds_kata_deploy_s_release(node, kata_deploy):
    """The release label and the plan, from the stand-in shim's --version (as from Kata's)."""
    deployed = kata_deploy["deployed"]
    wait_for(lambda: node.get()["metadata"].get("labels", {}).get(RELEASE_LABEL) == RELEASE,
             f"node label {RELEASE_LABEL}={RELEASE}", 90, every=1)
    changed = wait_for(lambda: len(node.events("KataChanged")) > kata_deploy["before"]["events"]
                       and node.events("KataChanged"), "the agent's KataChanged Event", 60, every=1)
    assert "kata-deploy" in changed[-1]["message"], changed[-1]["message"]
    plan = _agent_plan(node, deployed)
    found = {r["name"]: r for r in plan["kataFound"]["runtimes"]}
    gpu = found["kata-qemu-nvidia-gpu"]
    assert (gpu["shim"], gpu["configPath"], gpu["release"], gpu["releaseFrom"], gpu["installedBy"],
            gpu["flavour"], gpu["definedIn"]) == (
        GO_SHIM, CONFIG, RELEASE, "containerd-shim-kata-v2 --version", "kata-deploy", "go",
        "/opt/kata/containerd/config.d/kata-deploy.toml")
    rs = found[RS_CLASS]
    assert (rs["shim"], rs["flavour"], rs["release"]) == ("/opt/kata/runtime-rs/bin/containerd-shim-kata-v2",
                                                          "runtime-rs", RELEASE)
    assert plan["kataFound"]["release"] == RELEASE
    # The class kata-deploy provides: nothing pulled, only the GPU settings beside its config.
    artifacts = {a["runtimeClass"]: a for a in plan["artifacts"]}
    assert artifacts[KATA_CLASS]["action"] == "kata-deploy"
    assert artifacts[KATA_CLASS]["dropIn"] == "/opt/kata/" + GPU_DROP_IN


def test_the_agent_writes_its_gpu_drop_in_and_none_of_kata_deploy_s_files(node, kata_deploy):
    deployed = kata_deploy["deployed"]
    drop_in = node.cluster.host_root / "opt/kata" / GPU_DROP_IN
    wait_for(drop_in.is_file, f"the agent's GPU drop-in {drop_in}", 90, every=1)
    settings = tomllib.loads(drop_in.read_text())
    # 8 GPUs and the 4 NVSwitches local-node.yaml passes through, each on a root port.
    assert settings["hypervisor"]["qemu"]["pcie_root_port"] == 12
    assert "pod_resource_device_sources" in settings["runtime"]
    after = deployed.checksums()
    assert set(after) - set(kata_deploy["installed"]) == {GPU_DROP_IN}
    assert {k: v for k, v in after.items() if k != GPU_DROP_IN} == kata_deploy["installed"]


def test_the_admission_allows_kata_deploy_s_gpu_classes(node, kata_deploy):
    """A class kata-deploy's chart creates (helm-chart/kata-deploy/templates/runtimeclasses.yaml:
    name and handler kata-<shim>, its overhead, its node selector) that the chart does not know:
    the admission takes it for its Kata GPU handler."""
    node.run({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
              "metadata": {"name": RS_CLASS, "labels": {"app.kubernetes.io/managed-by": "kata-deploy",
                                                        "kata-deploy/instance": "default"}},
              "handler": RS_CLASS,
              "overhead": {"podFixed": {"memory": "10240Mi", "cpu": "1.0"}},
              "scheduling": {"nodeSelector": {"katacontainers.io/kata-runtime": "true"}}})
    result = node.cluster.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-",
                                  input=yaml.safe_dump(gpu_pod("rs-admitted", RS_CLASS)), check=False)
    assert result.returncode == 0, result.stderr
    admitted = json.loads(result.stdout)
    # The API server's RuntimeClass admission ran too: the class's overhead and node selector.
    stored = node.cluster.get("runtimeclass", RS_CLASS)
    assert admitted["spec"]["overhead"] == stored["overhead"]["podFixed"] == {"cpu": "1", "memory": "10Gi"}
    assert admitted["spec"]["nodeSelector"]["katacontainers.io/kata-runtime"] == "true"


def gpu_pod(name: str, runtime_class: str = KATA_CLASS, gpus: int = 2) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": PODS},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "runtimeClassName": runtime_class,
                     "containers": [{"name": "main", "image": IMAGE, "imagePullPolicy": "Never",
                                     "command": ["sh", "-c", "ls /dev/vfio; env; sleep 3600"],
                                     "resources": {"limits": {GPU_RESOURCE: gpus}}}]}}


def test_a_gpu_kata_pod_runs_through_kata_deploy_s_runtime(node, kata_deploy):
    deployed = kata_deploy["deployed"]
    node.wait_resource(GPU_RESOURCE, 8)
    node.run(gpu_pod("through-kata-deploy"))
    pod = node.wait_phase("through-kata-deploy", PODS)
    log = node.wait_log("through-kata-deploy", PODS, "PATH=")
    listed = log.split("PATH=")[0].split()
    assert "vfio" in listed and len([n for n in listed if n.isdigit()]) == 2, log
    # The sandbox is kata-deploy's runtime's: its runtime_type, Kata's options with its
    # ConfigPath, and the stand-in shim at kata-deploy's path serving it.
    container = pod["status"]["containerStatuses"][0]["containerID"].split("//")[1]
    info = json.loads(_ctr(node, "containers", "info", container))
    # containerd's CRI names the pod's sandbox in each container's spec (annotations.go).
    sandbox = info["Spec"]["annotations"]["io.kubernetes.cri.sandbox-id"]
    for cid in (sandbox, container):
        runtime = json.loads(_ctr(node, "containers", "info", cid))["Runtime"]
        assert runtime["Name"] == "io.containerd.kata-qemu-nvidia-gpu.v2", runtime
    shims = _shim_processes(deployed.prefix + GO_SHIM)
    assert any(f"-id {sandbox}" in cmd for cmd in shims.values()), (sandbox, shims)
    for cid in (sandbox, container):
        took = [line for line in node.cluster.log("containerd").splitlines()
                if "kata stand-in: Kata runtime options taken" in line and cid in line]
        assert took and deployed.prefix + CONFIG in took[-1], f"the stand-in logged no Kata options for {cid}"
    # The devices as for katamgr's own classes: the kubelet's CDI names resolved by containerd,
    # and Kata's own cold-plug code giving the VM exactly the pod's two GPUs.
    cdi = [line for line in node.cluster.log("containerd").splitlines()
           if container in line and "CDI devices from CRI Config.CDIDevices" in line]
    assert cdi and len(re.findall(r"nvidia\.com/[\w.-]+=[\w:.]+", cdi[-1])) == 2, cdi
    plug = vm_devices(node, PODS, "through-kata-deploy")
    env = dict(line.split("=", 1) for line in log.splitlines() if "=" in line)
    assert sorted(plug.functions) == sorted(env["PCI_RESOURCE_NVIDIA_COM_GH100H100_SXM5_80GB"].split(","))
    # Kata's own code (the oracle of the release kata-deploy laid out) decides the same.
    kata = ask_kata(node, "3.29.0", PODS, "through-kata-deploy")
    assert kata.ok, kata.error
    assert sorted(kata.plugged) == sorted(plug.functions)


def _shim_processes(exe: str) -> dict[int, str]:
    """pid -> command line of each process running the binary ``exe``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "exe") != exe:
                continue
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
    return found


def test_kata_deploy_uninstalled_the_node_is_as_it_was(node, kata_deploy):
    deployed = kata_deploy["deployed"]
    before = kata_deploy["before"]
    _take_off(node, deployed)
    kata_deploy["removed"] = True
    assert (node.cluster.dir / "containerd/config.toml").read_bytes() == before["containerd"]
    assert not deployed.checksums()
    wait_for(lambda: node.get()["metadata"].get("labels", {}).get(RELEASE_LABEL) == before["label"],
             f"node label {RELEASE_LABEL} back to {before['label']}", 90, every=1)
    node.wait_chart_ready()
    # The class is katamgr's own again: a Kata pod runs through the harness's handler.
    node.run(gpu_pod("after-kata-deploy", gpus=1))
    node.wait_phase("after-kata-deploy", PODS)
    node.delete_pod("after-kata-deploy", PODS)
