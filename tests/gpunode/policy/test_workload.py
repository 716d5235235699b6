"""The node's workload: one rule for ``katamgr --workload auto`` and ``sandbox-device-plugin --workload auto``."""

from __future__ import annotations

import pytest
from support.apiserver import FakeApiServer

from gpunode.errors import ConfigError, GpuNodeError
from gpunode.host.root import HostRoot
from gpunode.policy.workload import WORKLOAD_LABEL, NoCluster, Workload, resolve_workload
from katamgr.cli import build_parser
from katamgr.commands.setup import steps_and_context


def fallback():
    return Workload.VM_PASSTHROUGH, "the fallback"


def reader(value):
    """The node's labels, with the workload label ``value`` (None: not set)."""
    return lambda node: {} if value is None else {WORKLOAD_LABEL: value}


def test_the_label_wins_then_the_default_then_the_fallback():
    resolved = resolve_workload("n1", reader("vm-vgpu"), default="container", fallback=fallback)
    assert resolved.workload is Workload.VM_VGPU
    assert resolved.why == f"node n1 is labeled {WORKLOAD_LABEL}=vm-vgpu"
    # A node without the label (or with an empty one) runs the default...
    for value in (None, ""):
        resolved = resolve_workload("n1", reader(value), default="container", fallback=fallback)
        assert resolved.workload is Workload.CONTAINER and "--default-workload is container" in resolved.why
    # ... or, without one, the command's own fallback, as when nothing can be asked.
    assert resolve_workload("n1", reader(None), default=None, fallback=fallback).workload is Workload.VM_PASSTHROUGH

    def no_cluster(node):
        raise NoCluster("no kubeconfig")

    for node, read in ((None, reader("container")), ("", reader("container")), ("n1", None), ("n1", no_cluster)):
        resolved = resolve_workload(node, read, default="container", fallback=fallback)
        assert resolved.workload is Workload.VM_PASSTHROUGH and resolved.why.endswith("; the fallback")


def test_a_bad_label_or_a_failed_read_is_an_error_not_a_guess():
    with pytest.raises(ConfigError, match=r"node n1 has label nvidia.com/gpu.workload.config='VM', .*"
                                          r"container, vm-passthrough, vm-vgpu") as bad:
        resolve_workload("n1", reader("VM"), default="container", fallback=fallback)
    assert bad.value.exit_code == 2

    def forbidden(node):
        raise PermissionError("HTTP 403")

    with pytest.raises(GpuNodeError, match="could not read node n1's label .*HTTP 403") as failed:
        resolve_workload("n1", forbidden, default="container", fallback=fallback)
    assert failed.value.exit_code == 1

    def gone(node):
        raise GpuNodeError("node n1 does not exist in the cluster")

    with pytest.raises(GpuNodeError, match="^node n1 does not exist"):  # its own sentence, unchanged
        resolve_workload("n1", gone, default="container", fallback=fallback)


def test_katamgr_reads_the_label_through_the_api(tmp_path, monkeypatch):
    host = HostRoot.at(tmp_path / "node")
    host.root.mkdir()

    def workload(*args: str) -> Workload:
        return steps_and_context(build_parser().parse_args(["plan", *args]), host)[0].workload

    with FakeApiServer() as server:
        for name, labels in (("vgpu", {WORKLOAD_LABEL: "vm-vgpu"}), ("plain", {}),
                             ("typo", {WORKLOAD_LABEL: "vm-passthru"})):
            server.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}})
        monkeypatch.setenv("KUBECONFIG", str(server.write_kubeconfig(tmp_path / "kubeconfig")))
        assert workload("--node-name", "vgpu") is Workload.VM_VGPU
        assert workload("--node-name", "plain") is Workload.CONTAINER
        assert workload("--node-name", "plain", "--default-workload", "vm-passthrough") is Workload.VM_PASSTHROUGH
        assert workload("--node-name", "vgpu", "--workload", "container") is Workload.CONTAINER
        with pytest.raises(ConfigError, match="'vm-passthru'"):
            workload("--node-name", "typo")
        with pytest.raises(GpuNodeError, match="node gone does not exist"):
            workload("--node-name", "gone")
    monkeypatch.delenv("NODE_NAME", raising=False)
    # Run by hand with no node name: katamgr is there to set the node up for passthrough.
    assert workload() is Workload.VM_PASSTHROUGH


def test_opt_outs_are_the_gpu_operators_deploy_labels_set_to_false():
    """Label names and meaning from NVIDIA/gpu-operator controllers/state_manager.go:
    gpuStateLabels lists nvidia.com/gpu.deploy.<operand> per workload (vfio-manager,
    kata-manager, sandbox-validator, sandbox-device-plugin for vm-passthrough; the kata
    sandbox mode swaps in kata-sandbox-device-plugin, getEffectiveStateLabels), each
    operand's DaemonSet selects <label>: "true", addGPUStateLabels keeps a value someone
    set, and hasOperandsDisabled turns every operand off for operands=false."""
    from gpunode.policy.workload import OPERANDS_LABEL, Operand, opted_out

    assert opted_out({}) == frozenset()
    assert opted_out({"nvidia.com/gpu.deploy.vfio-manager": "false",
                      "nvidia.com/gpu.deploy.kata-manager": "true",
                      "nvidia.com/gpu.deploy.sandbox-validator": ""}) == {Operand.VFIO_MANAGER}
    assert opted_out({OPERANDS_LABEL: "false"}) == frozenset(Operand)
    assert {op.label for op in Operand} >= {
        "nvidia.com/gpu.deploy.vfio-manager", "nvidia.com/gpu.deploy.kata-manager",
        "nvidia.com/gpu.deploy.sandbox-validator", "nvidia.com/gpu.deploy.sandbox-device-plugin",
        "nvidia.com/gpu.deploy.kata-sandbox-device-plugin", "nvidia.com/gpu.deploy.device-plugin"}
    resolved = resolve_workload("n1", lambda node: {WORKLOAD_LABEL: "vm-passthrough", OPERANDS_LABEL: "false"},
                                default="container", fallback=fallback)
    assert resolved.workload is Workload.VM_PASSTHROUGH and resolved.opted_out == frozenset(Operand)


def test_katamgr_plan_and_apply_leave_out_what_the_node_opts_out_of(tmp_path, monkeypatch):
    from gpunode.policy.workload import Operand
    from katamgr.commands.setup import node_setup

    host = HostRoot.at(tmp_path / "node")
    host.root.mkdir()
    with FakeApiServer() as server:
        server.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1", "labels": {
            WORKLOAD_LABEL: "vm-passthrough", "nvidia.com/gpu.deploy.vfio-manager": "false"}}})
        monkeypatch.setenv("KUBECONFIG", str(server.write_kubeconfig(tmp_path / "kubeconfig")))
        setup = node_setup(build_parser().parse_args(["apply", "--node-name", "n1", "--no-kata"]), host)
    assert setup.opted_out == {Operand.VFIO_MANAGER}
    assert setup.workload_why.endswith("; it opts out of nvidia.com/gpu.deploy.vfio-manager=false")
    # What apply and plan act with: no binding; revert uses setup.steps and undoes it all.
    assert setup.steps.vfio and not setup.steps.without(setup.opted_out).vfio
