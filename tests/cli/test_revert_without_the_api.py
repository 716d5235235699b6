"""Revert on a node whose API server does not answer: the node's host state is reverted all
the same, one sentence says what is left on the Node object (its labels) and how to finish,
exit 1 as the table says ("the changes kept are listed with the command that undoes them"),
and no retry noise from the HTTP library.

Before: exit 1 with urllib3's "Retrying (Retry(total=2...))" lines. The API server here is a
kubeconfig naming a port nobody listens on (connection refused, as for a stopped API server).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from support.kataconfig import DEMO_CONTAINERD, kata_manager_yaml, prepare_node

from gpunode.kataclasses import GPU, OFFER_LABEL_PREFIX
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

KATAMGR = str(Path(sys.executable).parent / "katamgr")
PRODUCT = "nvidia.com/gpu.product"


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_revert_with_the_api_server_down_reverts_the_host_and_says_what_is_left(tmp_path):
    host = prepare_node(materialise(find_profile("workstation-a6000"), tmp_path / "host"))
    config = tmp_path / "kata.yaml"
    config.write_text(kata_manager_yaml((GPU,)))
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    root = ["--host-root", str(host.root)]
    assert subprocess.run([KATAMGR, "apply", *root, "--config", str(config)], capture_output=True,
                          timeout=120, env=env).returncode == 0
    # The GPU labels an agent with a cluster set on the Node (as its record lists them).
    host.state_path("gpu-labels.json").write_text(f'{{"version": 1, "labels": {{"{PRODUCT}": "NVIDIA-RTX-A6000"}}}}')
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "https://127.0.0.1:{closed_port()}", insecure-skip-tls-verify: true}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
""")
    result = subprocess.run([KATAMGR, "revert", *root, "--config", str(config), "--node-name", "n1",
                             "--workload", "vm-passthrough"], capture_output=True, text=True, timeout=120,
                            env=env | {"KUBECONFIG": str(kubeconfig)})
    assert result.returncode == 1, result.stderr
    # The host: all of it reverted.
    assert host.path("/sys/bus/pci/devices/0000:01:00.0/driver").resolve().name == "nvidia"
    assert host.path("/etc/containerd/config.toml").read_bytes() == DEMO_CONTAINERD.read_bytes()
    assert "restored 0000:01:00.0 to nvidia" in result.stdout
    # The API side: one sentence, what is left and how to finish.
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    assert "the API server did not answer (Failed to establish a new connection: [Errno 111] Connection " \
           "refused)" in errors[0]
    assert f"on its Node object n1 the labels {PRODUCT}, {OFFER_LABEL_PREFIX}* are left" in errors[0]
    assert f"`kubectl label node n1 {PRODUCT}- <each {OFFER_LABEL_PREFIX}* label>-`" in errors[0]
    assert "Retrying" not in result.stderr and "urllib3" not in result.stderr
    assert host.state_path("gpu-labels.json").exists()  # kept for the revert that finishes
