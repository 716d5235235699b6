"""``sandbox-device-plugin --workload auto`` follows its Node's labels without a restart, as
``katamgr run`` does: vm-passthrough serves the passthrough resources; a node the
plugin does not serve (``--auto-modes``), a vGPU node, or one that opts out of the GPU
Operator's sandbox device plugin (``nvidia.com/gpu.deploy.sandbox-device-plugin=false``,
or ``kata-sandbox-device-plugin`` in the operator's kata mode) gets nothing from it,
so two plugins never advertise one GPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from support.apiserver import FakeApiServer
from support.paths import REPO

from gpunode.host.pciids import PciIds
from gpunode.policy.naming import Naming
from gpunode.policy.workload import OPERANDS_LABEL, WORKLOAD_LABEL, Operand, Resolution, Workload
from katamgr.pipeline.devices import apply_host
from katamgr.pipeline.plan import build_plan
from sandbox_plugin.follow import PluginRunner, mode_for
from sandbox_plugin.manager import Mode, PluginManager

A10 = "nvidia.com/GA102GL_A10"
NODE = "worker-1"


def test_what_each_workload_and_opt_out_serves():
    def mode(workload, *out, modes=frozenset(Mode)):
        return mode_for(Resolution(Workload(workload), "why", frozenset(out)), modes)[0]

    assert mode("vm-passthrough") is Mode.VM_PASSTHROUGH
    assert mode("container") is Mode.CONTAINER
    assert mode("vm-vgpu") is None
    # The chart's sandbox agent pod: its container plugin DaemonSet serves container nodes.
    assert mode("container", modes=frozenset({Mode.VM_PASSTHROUGH})) is None
    for operand in (Operand.SANDBOX_DEVICE_PLUGIN, Operand.KATA_SANDBOX_DEVICE_PLUGIN):
        assert mode("vm-passthrough", operand) is None
        assert mode("container", operand) is Mode.CONTAINER  # not the container plugin's label
    assert mode("container", Operand.DEVICE_PLUGIN) is None
    assert mode("vm-passthrough", Operand.DEVICE_PLUGIN, Operand.VFIO_MANAGER) is Mode.VM_PASSTHROUGH
    why = mode_for(Resolution(Workload.VM_PASSTHROUGH, "labeled", frozenset({Operand.SANDBOX_DEVICE_PLUGIN})))[1]
    assert why == "labeled; the node opts out of nvidia.com/gpu.deploy.sandbox-device-plugin=false"


@pytest.fixture
def bound_a10(sim_host):
    host, kubelet = sim_host("a10-server")
    assert apply_host(host, build_plan(host, Naming(PciIds.find()))).ok
    return host, kubelet


def label(api: FakeApiServer, key: str, value: str | None) -> None:
    def change(node):
        labels = node["metadata"].setdefault("labels", {})
        if value is None:
            labels.pop(key, None)
        else:
            labels[key] = value
    api.update("nodes", NODE, change)


def auto_plugin(api: FakeApiServer, host, tmp_path) -> subprocess.Popen:
    """``sandbox-device-plugin --workload auto`` as the chart's sandbox agent pod runs it, following
    the Node (labelled vm-passthrough) that ``api`` holds."""
    api.seed({"apiVersion": "v1", "kind": "Node",
              "metadata": {"name": NODE, "labels": {WORKLOAD_LABEL: "vm-passthrough"}}})
    env = {**os.environ, "KUBECONFIG": str(api.write_kubeconfig(tmp_path / "kubeconfig"))}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    return subprocess.Popen(
        [sys.executable, "-m", "sandbox_plugin.cli", "--host-root", str(host.root), "--workload", "auto",
         "--auto-modes", "vm-passthrough", "--node-name", NODE],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)


def test_the_plugin_follows_relabels_and_opt_outs_without_a_restart(bound_a10, tmp_path):
    host, kubelet = bound_a10
    with FakeApiServer() as api:
        process = auto_plugin(api, host, tmp_path)
        socket = kubelet.socket_dir / "nvidia.com-GA102GL_A10.sock"
        try:
            kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4, timeout=20)
            for change, serving in (
                # The container plugin's node now: no pod holds a GPU, so none is listed
                # (the server stays, for the GPUs pods would still hold).
                ((WORKLOAD_LABEL, "container"), None),
                ((WORKLOAD_LABEL, "vm-passthrough"), True),
                ((Operand.SANDBOX_DEVICE_PLUGIN.label, "false"), False),
                ((Operand.SANDBOX_DEVICE_PLUGIN.label, None), True),
                ((OPERANDS_LABEL, "false"), False),
                ((OPERANDS_LABEL, None), True),
            ):
                started = time.monotonic()
                label(api, *change)
                if serving:
                    kubelet.wait_for(lambda s: A10 in s.connected and len(s.healthy(A10)) == 4, timeout=10)
                elif serving is None:
                    kubelet.wait_for(lambda s: A10 in s.connected and s.devices[A10] == [], timeout=10)
                else:
                    # The servers stop and remove their sockets: the kubelet loses the endpoint.
                    kubelet.wait_for(lambda s: A10 not in s.connected, timeout=10)
                    # The stream ends as the server stops; the socket file goes just after.
                    deadline = time.monotonic() + 5
                    while socket.exists() and time.monotonic() < deadline:
                        time.sleep(0.02)
                    assert not socket.exists()
                assert time.monotonic() - started < 5, change
        finally:
            process.send_signal(signal.SIGTERM)
            output, _ = process.communicate(timeout=15)
    assert process.returncode == 0, output
    assert "mode none (advertising only the passthrough devices pods still hold): node worker-1 is labeled " \
           "nvidia.com/gpu.workload.config=container; this plugin serves only vm-passthrough (--auto-modes)" in output
    assert "mode none (advertising nothing): node worker-1 is labeled nvidia.com/gpu.workload.config=vm-passthrough; " \
           "the node opts out of nvidia.com/gpu.deploy.sandbox-device-plugin=false" in output
    assert "the node opts out of nvidia.com/gpu.deploy.sandbox-device-plugin=false" in output
    # One watch, no restarts: every switch came from the same process.
    assert output.count("mode vm-passthrough:") == 4


def test_on_a_container_node_the_devices_pods_hold_stay_listed_and_are_never_allocated(bound_a10, tmp_path):
    """Relabelled to container while a Kata pod holds one GPU: the plugin keeps listing that
    one (Healthy: a restarted kubelet re-admits its running pods against the Node's
    allocatable, and kills a pod whose resource has none: pkg/kubelet/lifecycle/predicate.go,
    seen on tests/node), refuses every Allocate, lists none of the free ones, and drops it
    once the pod is gone."""
    import grpc

    host, kubelet = bound_a10
    with FakeApiServer() as api:
        process = auto_plugin(api, host, tmp_path)
        try:
            kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4, timeout=20)
            answers = kubelet.admit_pod("vms", "kata-a", {"main": {A10: 1}})
            [held] = [d for d in kubelet.state.pods[0].containers[0].devices[A10]]
            assert answers["main"][A10].devices
            label(api, WORKLOAD_LABEL, "container")
            state = kubelet.wait_for(lambda s: A10 in s.connected and [d.id for d in s.devices[A10]] == [held],
                                     timeout=10)
            assert state.healthy(A10) == [held]
            with pytest.raises(grpc.RpcError) as refused:
                kubelet.allocate(A10, [held])
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "no longer runs vm-passthrough" in refused.value.details()
            # A kubelet restart re-admits the pod against what the Node lists: it fits.
            kubelet.restart()
            kubelet.wait_for(lambda s: [d.id for d in s.devices.get(A10, [])] == [held], timeout=10)
            assert [p.name for p in kubelet.state.pods] == ["kata-a"] and kubelet.state.ended == []
            kubelet.remove_pod("vms", "kata-a")  # the pod ends
            kubelet.wait_for(lambda s: s.devices.get(A10) == [], timeout=10)
            label(api, WORKLOAD_LABEL, "vm-passthrough")
            kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4, timeout=10)
        finally:
            process.send_signal(signal.SIGTERM)
            output, _ = process.communicate(timeout=15)
    assert process.returncode == 0, output
    assert "serving only the devices pods still hold (nvidia.com/GA102GL_A10: 1); every Allocate refused" in output


def test_a_plugin_that_stood_down_under_a_pod_gets_that_pod_ended_by_a_kubelet_restart(bound_a10, tmp_path):
    """The contrast, and why the GPUs pods hold stay listed: a node opted out of the sandbox
    device plugin while a pod holds a GPU; the plugin stands down (its devices Unhealthy
    at the kubelet), and a restarted kubelet ends the pod: "OutOfnvidia.com/GA102GL_A10"."""
    host, kubelet = bound_a10
    with FakeApiServer() as api:
        process = auto_plugin(api, host, tmp_path)
        try:
            kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4, timeout=20)
            kubelet.admit_pod("vms", "kata-a", {"main": {A10: 1}})
            label(api, Operand.SANDBOX_DEVICE_PLUGIN.label, "false")
            kubelet.wait_for(lambda s: A10 not in s.connected and s.healthy(A10) == [], timeout=10)
            kubelet.restart()
            [(pod, reason)] = kubelet.state.ended
            assert pod.name == "kata-a" and reason == f"OutOf{A10}"
        finally:
            process.send_signal(signal.SIGTERM)
            process.communicate(timeout=15)


def test_a_relabel_racing_shutdown_leaves_no_plugin_serving(bound_a10):
    """``PluginRunner.stop()`` (the plugin's SIGTERM) is final: a relabel whose plugins were being
    made as it ran starts nothing, and a manager stopped before its start stays stopped. Else its
    servers would register with the kubelet after the process meant to have stood down."""
    host, kubelet = bound_a10
    made: list[PluginManager] = []

    def make(mode, metrics, held_only=False):
        manager = PluginManager(host, mode, naming=Naming(PciIds.find()), metrics=metrics, held_only=held_only)
        made.append(manager)
        stopping = threading.Thread(target=runner.stop)  # the shutdown, while this relabel's plugins are made
        stopping.start()
        stopping.join(5)
        return manager

    runner = PluginRunner(make)
    assert not runner.serve(Mode.VM_PASSTHROUGH, "labeled vm-passthrough")
    assert runner.manager is None and not runner.serve(Mode.VM_PASSTHROUGH, "labeled again")
    [manager] = made
    assert manager.servers == {} and manager.health() == (False, "the plugin manager is not running")
    assert not (kubelet.socket_dir / "nvidia.com-GA102GL_A10.sock").exists()

    early = PluginManager(host, Mode.VM_PASSTHROUGH, naming=Naming(PciIds.find()))
    early.stop()
    early.start()
    assert early.servers == {} and not (kubelet.socket_dir / "nvidia.com-GA102GL_A10.sock").exists()
    assert kubelet.state.registrations == []
