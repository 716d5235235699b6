"""The node suite: the chart on a real kubelet.

One cluster for this directory (package scope): ``hack/local-cluster up DIR --node`` (the
control plane of tests/controlplane plus containerd 2.x, a kubelet and kube-proxy on this
machine, node ``local-node`` on a simulated DGX H100 in DIR/host, the chart's image and a
pause image imported from hack/image/build), the node labelled vm-passthrough, then
``hack/local-chart up DIR --node`` (the chart rendered by the real Helm engine with
examples/values/local-node.yaml, applied server-side). Every pod here is started by the
real kubelet from our image: the agent, both device plugins, the webhook. What is still a
stand-in: the Kata guest (the Kata runtime handler runs runc's shim; kata-deploy's, installed by
test_node_katadeploy.py, a stand-in built on it), the GPUs (the
simulated node's sysfs, /dev/vfio nodes that reach no device) and NVML.

Needs root, runc, the CNI plugins, iptables and mmdebstrap (bash .ci/setup installs them);
under REQUIRE_INTEGRATION=1 a missing part fails the suite. Its time is printed in the
terminal summary ("node suite: ...").
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from support.kubecluster import LocalCluster, missing_part
from support.nodekit import WORKLOAD, Node, started_processes
from support.nodeswitch import NAMESPACE as FAULT_NAMESPACE
from support.nodeswitch import PASSTHROUGH, SLOW_MS, VmPod, relabel, settled
from support.paths import REQUIRE_INTEGRATION

_timing: dict[str, float] = {"tests": 0.0}
_figures: list[str] = []  # lines the modules measured (issue figures), printed, never asserted


def pytest_collection_modifyitems(items):
    for item in items:
        if "node" in item.nodeid.split("/")[:2]:
            item.add_marker(pytest.mark.integration)


def missing_node_part() -> str | None:
    why = missing_part()
    if why:
        return why
    if os.geteuid() != 0:
        return "the node suite runs a kubelet and containerd: it needs root"
    for tool, package in (("runc", "runc"), ("iptables", "iptables"),
                          ("mmdebstrap", "mmdebstrap"), ("conntrack", "conntrack")):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"{tool} is not installed (run: bash .ci/setup, or apt-get install {package})"
    if not Path("/usr/lib/cni/bridge").exists():
        return "the CNI plugins are not installed (apt-get install containernetworking-plugins)"
    return None


@pytest.fixture(scope="package")
def node():
    why = missing_node_part()
    if why:
        if REQUIRE_INTEGRATION:
            pytest.fail(why)
        pytest.skip(why)
    # Short: the kubelet's plugin sockets live below DIR/host and a unix socket path
    # holds 107 bytes.
    directory = Path(tempfile.mkdtemp(prefix="ksm-node-", dir="/tmp"))
    before = _processes()
    cluster = LocalCluster.up(directory / "c", node=True)
    _timing["start"] = cluster.start_seconds
    the_node = Node(cluster)
    try:
        the_node.label(WORKLOAD, "vm-passthrough")
        the_node.cluster_chart("up")
        the_node.wait_chart_ready()
        yield the_node
    finally:
        print(cluster.down())
        # `down` leaves no process it started, directly or through containerd (its shims,
        # the pods' containers): the process table against the one before `up`.
        left = {pid: cmd for pid, cmd in started_processes(directory).items()
                if (pid, _start_time(pid)) not in before}
        shutil.rmtree(directory, ignore_errors=True)
        assert not left, f"hack/local-cluster down left {len(left)} processes running: {left}"


@pytest.fixture(scope="module")
def resident(node):
    """For a module of workload-switch faults (test_node_switch_*.py): the slowed kernel, and
    the Kata VM that runs through every fault of the module; the node back on vm-passthrough
    after."""
    node.cluster.namespace(FAULT_NAMESPACE)
    settled(node, PASSTHROUGH, [])
    node.kernel(driver_write_ms=SLOW_MS)
    vm = VmPod(node, "resident", 1)
    try:
        yield vm
    finally:
        node.kernel(driver_write_ms=0)
        vm.end()
        relabel(node, PASSTHROUGH)
        settled(node, PASSTHROUGH, [])


@pytest.fixture(autouse=True)
def _fault_pods_ended(request):
    """After each workload-switch test, its own Kata pods (and their VMs) ended even when it
    failed half-way: their GPUs stay held on vfio-pci, so every test after it (and the
    uninstall's revert, which waits for held GPUs) would fail for the first one's fault."""
    if "resident" not in request.fixturenames:
        yield
        return
    node = request.getfixturevalue("node")
    vms, pods = list(VmPod.live), _fault_pods(node)
    yield
    for vm in [vm for vm in VmPod.live if vm not in vms]:
        vm.end()
    for name in _fault_pods(node) - pods:
        node.delete_pod(name, FAULT_NAMESPACE)


def _fault_pods(node) -> set[str]:
    out = node.cluster.kubectl("get", "pods", "-n", FAULT_NAMESPACE, "-o", "name").stdout
    return {line.split("/", 1)[1] for line in out.split()}


def _processes() -> set[tuple[int, str]]:
    return {(int(p), _start_time(int(p))) for p in os.listdir("/proc") if p.isdigit()}


def _start_time(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


@pytest.fixture(scope="session")
def node_figures() -> list[str]:
    """Lines for the terminal summary: a figure a test measured on the real node."""
    return _figures


def pytest_runtest_logreport(report) -> None:
    if "/node/" in "/" + report.nodeid:
        _timing["tests"] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if "start" in _timing:
        terminalreporter.write_line(
            f"node suite: {_timing['tests']:.0f} s "
            f"(hack/local-cluster up --node {_timing['start']:.1f} s)")
    for line in _figures:
        terminalreporter.write_line(line)
