"""``sandbox-dra-driver`` as a command: its flags, bad input, and a run as its own
process against the API server stand-in, following its Node's workload label."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from drakit import DRIVER, NODE, make_node
from support.paths import REPO

WORKLOAD = "nvidia.com/gpu.workload.config"


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sandbox_plugin.dra.cli", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=60, env=env)


@pytest.mark.parametrize(("args", "message"), [
    (["--node-name", "n", "--driver-name", "Passthrough_GPU"],
     "--driver-name 'Passthrough_GPU' is not a DRA driver name: use a lower-case DNS subdomain of at "
     "most 63 characters"),
    (["--node-name", "n", "--driver-name", "a" * 64 + ".io"], "is not a DRA driver name"),
    (["--node-name", "n", "--kubelet-dir", "var/lib/kubelet"],
     "--kubelet-dir: 'var/lib/kubelet' is not an absolute path"),
    (["--node-name", "n", "--host-root", "/nonexistent-root"], "--host-root '/nonexistent-root' is not a directory"),
    (["--node-name", "n", "--include-device", "1234:11e8"], "'1234:11e8' is not VENDOR:DEVICE=RESOURCE"),
    (["--node-name", "n", "--kata-runtime-class", "Kata_QEMU"],
     "--kata-runtime-class 'Kata_QEMU' is not a RuntimeClass name"),
    (["--node-name", "n", "--any-runtime-class", "--kata-runtime-class", "kata"],
     "--any-runtime-class and --kata-runtime-class contradict each other"),
])
def test_bad_input_exits_2_naming_the_value(args, message):
    result = run(*args, env={k: v for k, v in os.environ.items() if k != "NODE_NAME"})
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_no_node_name_exits_2():
    env = {k: v for k, v in os.environ.items() if k != "NODE_NAME"}
    result = run(env=env)
    assert result.returncode == 2
    assert "no node name: pass --node-name or set NODE_NAME" in result.stderr


def test_no_cluster_exits_1(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"},
           "KUBECONFIG": str(tmp_path / "none"), "HOME": str(tmp_path)}
    result = run("--node-name", "n", "--host-root", str(tmp_path), env=env)
    assert result.returncode == 1
    assert "no Kubernetes API to read claims from and publish to" in result.stderr


def test_the_command_publishes_and_follows_its_node_label(tmp_path):
    node, cleanup = make_node(start=False)
    try:
        node.server.update("nodes", NODE, lambda n: n["metadata"].setdefault("labels", {}).update(
            {WORKLOAD: "vm-passthrough"}))
        kubeconfig = node.server.write_kubeconfig(tmp_path / "kubeconfig")
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        # --nvlink-fabric off: this test is about the label; the board's model is
        # test_nvlink_gate's (with auto and no FM answering its GPUs would stay out).
        process = subprocess.Popen(
            [sys.executable, "-m", "sandbox_plugin.dra.cli", "--host-root", str(node.host.root),
             "--node-name", NODE, "--nvswitches", "true", "--nvlink-fabric", "off"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
        try:
            node.dra.wait_for(lambda s: s.current(DRIVER) is not None, timeout=30)
            wait(lambda: node.slices(), "the slice")
            assert len(node.slice()["spec"]["devices"]) == 12
            for value, published in (("container", False), ("vm-passthrough", True)):
                node.server.update("nodes", NODE, lambda n, v=value: n["metadata"]["labels"].update(
                    {WORKLOAD: v}))
                wait(lambda p=published: bool(node.slices()) == p, f"slice published: {published}")
        finally:
            process.send_signal(signal.SIGTERM)
            output, _ = process.communicate(timeout=20)
        assert process.returncode == 0, output
        assert not node.host.path(f"/var/lib/kubelet/plugins_registry/{DRIVER}-reg.sock").exists()
        assert "removing the node's ResourceSlice: node dgx-1 is labeled nvidia.com/gpu.workload.config=container" in output
        assert node.slices(), "a stopped driver leaves its slice for the next run"
    finally:
        cleanup()


def wait(check, what: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)


def test_a_workload_chosen_with_the_flag_wins_over_the_label(tmp_path):
    """--workload (as katamgr's and the device plugin's) fixes what the driver serves: the
    node's label is not asked, so a container-labeled node still gets its slice."""
    node, cleanup = make_node(start=False)
    try:
        node.server.update("nodes", NODE, lambda n: n["metadata"].setdefault("labels", {}).update(
            {WORKLOAD: "container"}))
        env = {**os.environ, "KUBECONFIG": str(node.server.write_kubeconfig(tmp_path / "kubeconfig"))}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        process = subprocess.Popen(
            [sys.executable, "-m", "sandbox_plugin.dra.cli", "--host-root", str(node.host.root),
             "--node-name", NODE, "--workload", "vm-passthrough", "--nvlink-fabric", "off"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
        try:
            wait(lambda: node.slices(), "the slice", timeout=30)
        finally:
            process.send_signal(signal.SIGTERM)
            output, _ = process.communicate(timeout=20)
        assert process.returncode == 0, output
        assert "removing the node's ResourceSlice" not in output  # the container label was not asked
    finally:
        cleanup()
