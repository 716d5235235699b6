"""``katamgr fleet``: every node's state from the API alone, as a table and as a versioned
document, with the caller's kubeconfig (the API stand-in here), writing nothing."""

from __future__ import annotations

import json

from support.apiserver import FakeApiServer

from katamgr import cli

GPU = "nvidia.com/GA102GL_A10"


def node(name: str, labels: dict, conditions: list, capacity: dict | None = None,
         allocatable: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "status": {"conditions": conditions, "capacity": capacity or {}, "allocatable": allocatable or {}}}


def condition(type_: str, status: str, reason: str, at: str) -> dict:
    return {"type": type_, "status": status, "reason": reason, "message": f"{reason} message",
            "lastHeartbeatTime": at, "lastTransitionTime": at}


def seed(api) -> None:
    api.seed(node("gpu-a", {"nvidia.com/gpu.workload.config": "vm-passthrough",
                            "katacontainers.io/kata-version": "3.21.0",
                            "runtimeclass.kata-sandbox-manager.io/kata-qemu-nvidia-gpu": "true"},
                  [condition("Ready", "True", "KubeletReady", "2026-01-01T00:00:00Z"),
                   condition("SandboxGPUsReady", "True", "GPUsBound", "2026-01-02T00:00:00Z"),
                   condition("SandboxGPUHealthy", "False", "GPUUnhealthy", "2026-01-03T00:00:00Z")],
                  {GPU: "4", "cpu": "64"}, {GPU: "3", "cpu": "63"}))
    api.seed(node("cpu-b", {}, [condition("Ready", "True", "KubeletReady", "2026-01-01T00:00:00Z")]))


def test_the_table_names_each_nodes_state(tmp_path, monkeypatch, capsys):
    with FakeApiServer() as api:
        seed(api)
        monkeypatch.setenv("KUBECONFIG", str(api.write_kubeconfig(tmp_path / "kubeconfig")))
        assert cli.main(["fleet"]) == 0
        assert api.writes() == []
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["NODE", "WORKLOAD"]
    cpu, gpu = lines[1], lines[2]
    assert cpu.split()[0] == "cpu-b" and cpu.split()[1] == "-"
    fields = gpu.split()
    assert fields[:4] == ["gpu-a", "vm-passthrough", "3.21.0", "kata-qemu-nvidia-gpu"]
    assert "GPUHealthy=False(GPUUnhealthy)" in gpu and "GPUsReady" not in gpu  # the True ones not listed
    assert "GA102GL_A10:1" in gpu and fields[-1] == "2026-01-03T00:00:00Z"


def test_json_is_a_versioned_document_of_facts(tmp_path, monkeypatch, capsys):
    with FakeApiServer() as api:
        seed(api)
        monkeypatch.setenv("KUBECONFIG", str(api.write_kubeconfig(tmp_path / "kubeconfig")))
        assert cli.main(["fleet", "-o", "json", "-l", "nvidia.com/gpu.workload.config=vm-passthrough"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "Fleet" and doc["apiVersion"].startswith("kata-sandbox-manager.io/")
    (gpu,) = doc["nodes"]
    assert gpu["name"] == "gpu-a" and gpu["unhealthyGpus"] == {GPU: 1}
    assert [c["type"] for c in gpu["conditions"]] == ["SandboxGPUHealthy", "SandboxGPUsReady"]  # ours only
    assert gpu["lastTransitionTime"] == "2026-01-03T00:00:00Z"


def test_without_a_cluster_it_says_how_to_name_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert cli.main(["fleet"]) == 2
    assert "KUBECONFIG" in capsys.readouterr().err
