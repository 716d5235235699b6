"""``sandbox-device-plugin --workload auto`` following its Node through the real API server,
as the chart's sandbox agent pod runs it (its ServiceAccount's token, --auto-modes
vm-passthrough): a relabel to container leaves no passthrough device offered (the plugin
stays registered, listing only the devices pods still hold, none here, so a pod holding one
keeps it across a kubelet restart), back to vm-passthrough serves them again, all in one
process. The kubelet is our simulator
(the real one needs containerd and a node: the node issue)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from support.chartkit import render_release
from support.paths import REPO

from gpunode.host.pciids import PciIds
from gpunode.policy.naming import Naming
from katamgr.pipeline.devices import apply_host
from katamgr.pipeline.plan import build_plan
from nodesim.kubelet import KubeletSimulator
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

pytestmark = pytest.mark.integration

RELEASE = "ksm-plugin"
NODE = "sim-a10-1"
A10 = "nvidia.com/GA102GL_A10"
WORKLOAD = "nvidia.com/gpu.workload.config"


def test_the_plugin_follows_its_node_through_the_real_api(kube, tmp_path):
    objects = render_release({"sandboxWorkloads": {"enabled": True}}, RELEASE)
    accounts = [o for o in objects if o["kind"] in
                ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
                and "helm.sh/hook" not in o["metadata"].get("annotations", {})]
    kube.namespace(RELEASE)
    kube.apply(accounts, namespace=RELEASE)
    kube.apply([{"apiVersion": "v1", "kind": "Node",
                 "metadata": {"name": NODE, "labels": {WORKLOAD: "vm-passthrough"}}}], manager="test")
    directory = tempfile.mkdtemp(prefix="kp-")  # short: unix socket paths are limited
    host = materialise(find_profile("a10-server"), directory)
    assert apply_host(host, build_plan(host, Naming(PciIds.find()))).ok
    kubelet = KubeletSimulator(host)
    kubelet.start()
    # The sandbox agent pod's own ServiceAccount (each workload of the chart has its own).
    account = next(o for o in accounts if o["kind"] == "ServiceAccount"
                   and o["metadata"]["name"].endswith("-sandbox-agent"))["metadata"]["name"]
    kubeconfig = kube.service_account_kubeconfig(RELEASE, account, tmp_path / "plugin.kubeconfig")
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "sandbox_plugin.cli", "--host-root", str(host.root), "--workload", "auto",
         "--auto-modes", "vm-passthrough", "--node-name", NODE],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    timings = []
    try:
        kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4, timeout=30)
        for value, serving in (("container", False), ("vm-passthrough", True),
                               ("container", False), ("vm-passthrough", True)):
            started = time.monotonic()
            kube.kubectl("label", "node", NODE, f"{WORKLOAD}={value}", "--overwrite")
            if serving:
                kubelet.wait_for(lambda s: A10 in s.connected and len(s.healthy(A10)) == 4, timeout=15)
            else:
                kubelet.wait_for(lambda s: not s.healthy(A10), timeout=15)
            timings.append(time.monotonic() - started)
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=20)
        kubelet.stop()
        kube.kubectl("delete", "node", NODE, "--wait=false", check=False)
        kube.delete(accounts, namespace=RELEASE)
    assert process.returncode == 0, output
    assert output.count("mode vm-passthrough:") == 3, output
    assert "forbidden" not in output.lower(), output
    assert max(timings) < 10, timings
