"""The README's "Try it on a local cluster", as a newcomer types it after `hack/local-cluster
up`: `hack/local-chart up` (the chart with examples/values/local-cluster.yaml, its webhook
run here), a passthrough pod without a Kata runtime class refused, a GPU-less pod
mutated, `hack/local-chart down` taking it all away again."""

from __future__ import annotations

import json
import subprocess

import pytest
from support.kubecluster import wait_for
from support.paths import REPO

pytestmark = pytest.mark.integration

KATA_POD = (REPO / "examples" / "pods" / "cuda-vectoradd-kata.yaml").read_text()


def test_the_readme_local_cluster_flow(kube):
    up = subprocess.run([str(REPO / "hack" / "local-chart"), "up", str(kube.dir)],
                        capture_output=True, text=True, timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        assert "chart kata-sandbox-manager applied to namespace gpu-sandbox" in up.stdout
        without_kata = "\n".join(line for line in KATA_POD.splitlines()
                                 if "runtimeClassName" not in line)

        def refused():
            result = kube.kubectl("apply", "--dry-run=server", "-f", "-", input=without_kata, check=False)
            return result.stderr if result.returncode else None

        refusal = wait_for(refused, "the Kata pod without its runtime class refused")
        assert ("requests the passthrough resource nvidia.com/GA102GL_A10, but it sets no "
                "runtimeClassName") in refusal, refusal

        def voided():
            result = kube.kubectl("run", "demo", "--image=busybox", "-n", "default", "--dry-run=server",
                                  "-o", "json", check=False)
            if result.returncode:
                return None
            env = json.loads(result.stdout)["spec"]["containers"][0].get("env", [])
            return env if {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in env else None

        wait_for(voided, "a GPU-less pod given NVIDIA_VISIBLE_DEVICES=void")
    finally:
        down = subprocess.run([str(REPO / "hack" / "local-chart"), "down", str(kube.dir)],
                              capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert "stopped katamgr webhook" in down.stdout
    hooks = kube.kubectl("get", "mutatingwebhookconfigurations", "-o", "name").stdout
    assert "kata-sandbox-manager" not in hooks
