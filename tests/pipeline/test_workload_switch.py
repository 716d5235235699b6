"""``katamgr run`` follows its Node's ``nvidia.com/gpu.workload.config`` label without a
restart: vm-passthrough -> container gives the free GPUs back and keeps (and reports)
the ones a running VM or pod holds; container -> vm-passthrough binds again. The Node is
watched, so a relabel is acted on at once however long the check interval; the GPU
Operator's opt-out labels (``nvidia.com/gpu.deploy.<operand>=false``) take parts away."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import replace
from pathlib import Path

from support.agentkit import make_agent
from support.apiserver import FakeApiServer
from support.hostkit import GPU_A10, dev, driver_of, make_host
from support.paths import REPO
from support.waiting import wait_for

from gpunode.host.pciids import PciIds
from gpunode.policy.naming import Naming
from gpunode.policy.readiness import VFIO_READY, WORKLOAD_TYPE
from gpunode.policy.workload import OPERANDS_LABEL, WORKLOAD_LABEL, Operand, Workload
from gpunode.services.podresources import POD_RESOURCES_SOCKET, list_pod_devices
from katamgr.agent import Agent
from katamgr.agent.following import node_follower
from katamgr.cluster import EventRecorder
from katamgr.config import parse_config
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.reconcile import Steps, reconcile
from nodesim.podresources import (
    ContainerRecord,
    PodRecord,
    PodResourcesServer,
    Snapshot,
)

NAMING = Naming(PciIds.find())
CONFIG = """
artifactsDir: /opt/nvidia-gpu-operator/artifacts/runtimeclasses
runtimeClasses:
  - name: kata-qemu-nvidia-gpu
    artifacts: {url: "oci-layout:///opt/kata-artifacts/layout:kata-qemu-nvidia-gpu"}
containerd: {restartMode: none}
"""
NODE = "gpu-node-1"
HELD, FREE = "0000:01:00.0", "0000:02:00.0"  # IOMMU groups 4 and 5
A10 = "nvidia.com/GA102GL_A10"  # the resource the plugin advertises them under


def node(tmp_path):
    import shutil

    host = make_host(tmp_path, [dev(HELD, GPU_A10, "nvidia", 4), dev(FREE, GPU_A10, "nvidia", 5)])
    host.path("/etc/containerd").mkdir(parents=True)
    host.path("/etc/containerd/config.toml").write_text(
        (REPO / "katamgr" / "data" / "demo" / "containerd-config.toml").read_text())
    shutil.copytree(REPO / "katamgr" / "data" / "oci-layout", host.path("/opt/kata-artifacts/layout"))
    return host


def hold(host, group: int, pid: int = 7777):
    """A QEMU of a running Kata VM holding /dev/vfio/<group>, as the node's /proc shows it."""
    fd_dir = host.path(f"/proc/{pid}/fd")
    fd_dir.mkdir(parents=True)
    (fd_dir.parent / "comm").write_text("qemu-system-x86\n")
    (fd_dir / "12").symlink_to(f"/dev/vfio/{group}")
    return fd_dir / "12"


def relabel(api: FakeApiServer, workload: str | None, key: str = WORKLOAD_LABEL) -> None:
    """Set (None: remove) one of the Node's labels, as `kubectl label node` does."""
    def change(n):
        labels = n["metadata"].setdefault("labels", {})
        if workload is None:
            labels.pop(key, None)
        else:
            labels[key] = workload
    api.update("nodes", NODE, change)


def follower(api: FakeApiServer):
    """What `katamgr run --workload auto --node-name NODE` follows, its watch started."""
    followed = node_follower(api.client(), NODE, workload="auto", default_workload="container",
                             fallback=lambda: (Workload.VM_PASSTHROUGH, "by hand"))
    return followed.read, followed.watch.start()


@contextlib.contextmanager
def followed_node(host, steps: Steps, *, ctx=None, label: str = "vm-passthrough", events: bool = False,
                  check_interval: float = 0.05):
    """An API server holding the Node labeled ``label``, and an Agent following it as
    ``katamgr run --workload auto`` does (its loop not started): (api, agent, watch)."""
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node",
                  "metadata": {"name": NODE, "labels": {WORKLOAD_LABEL: label}}})
        read, watch = follower(api)
        agent = make_agent(host, NAMING, steps, ctx, check_interval=check_interval,
                      events=EventRecorder(api.client(), NODE) if events else None,
                      read_workload=read, node_watch=watch)
        yield api, agent, watch


def switch_lines(caplog, start: str = "workload switch") -> list[str]:
    """The lines that say what a switch did (not the one saying it began)."""
    return [r.getMessage() for r in caplog.records
            if start in r.getMessage() and not r.getMessage().endswith(": starting")]


def events(api: FakeApiServer, reason: str) -> list[dict]:
    """The Events recorded on the Node with this reason."""
    found = [api.get("events", n, "default") for n in api.names("events")]
    return [e for e in found if e and e["reason"] == reason]


def driver_now(host, bdf: str) -> str | None:
    """The device's driver, None while the (emulated) kernel is moving it."""
    try:
        return driver_of(host, bdf)
    except OSError:
        return None


def cdi_text(host) -> str:
    spec_dir = host.path("/var/run/cdi")
    return "".join(p.read_text() for p in sorted(spec_dir.glob("*"))) if spec_dir.is_dir() else ""


def test_relabel_gives_free_gpus_back_keeps_held_ones_and_binds_again(tmp_path, caplog):
    caplog.set_level("INFO", logger="katamgr.agent")
    host = node(tmp_path)
    with followed_node(host, Steps(), ctx=KataContext(parse_config(CONFIG)), events=True) as (api, agent, watch):
        assert agent.switcher.read_workload().workload is Workload.VM_PASSTHROUGH
        assert agent.reconcile("start").ok
        assert driver_of(host, HELD) == driver_of(host, FREE) == "vfio-pci"
        assert host.path(WORKLOAD_TYPE).read_text() == "vm-passthrough\n"
        assert "/dev/vfio/4" in cdi_text(host) and "/dev/vfio/5" in cdi_text(host)
        containerd = host.path("/etc/containerd/config.toml").read_text()
        assert "kata-qemu-nvidia-gpu" in containerd
        held = hold(host, 4)

        thread = threading.Thread(target=agent.loop, daemon=True)
        thread.start()
        try:
            relabel(api, "container")
            assert wait_for(lambda: agent.target.steps.workload is Workload.CONTAINER)
            # The free GPU went back to its driver; the one the VM holds stayed and is reported.
            assert driver_of(host, FREE) == "nvidia"
            assert driver_of(host, HELD) == "vfio-pci"
            assert agent.give_backs.held == {HELD}
            assert not agent.give_backs.waiting
            assert host.path(WORKLOAD_TYPE).read_text() == "container\n"
            assert not host.path(VFIO_READY).exists()
            specs = cdi_text(host)
            assert "/dev/vfio/4" in specs and "/dev/vfio/5" not in specs  # the specs follow
            # The Kata runtime entries stay (running VMs use them).
            assert host.path("/etc/containerd/config.toml").read_text() == containerd
            switches = switch_lines(caplog)
            assert len(switches) == 1
            line = switches[0]
            assert line.startswith("workload switch vm-passthrough -> container: ")
            assert f"gave {FREE} back" in line and f"{HELD} (PID 7777 (qemu-system-x86)" in line
            # No kubelet on this node: said so, and only the VMs' open nodes counted.
            assert any("could not ask the kubelet which pods hold GPUs" in r.getMessage()
                       and "PodResources socket" in r.getMessage() for r in caplog.records)
            assert "Kata runtime entries in containerd stay" in line
            assert wait_for(lambda: len(events(api, "WorkloadSwitched")) == 1)
            assert events(api, "WorkloadSwitched")[0]["message"] == line
            assert agent.metrics.registry.get_sample_value(
                "katamgr_workload_switches_total", {"from": "vm-passthrough", "to": "container"}) == 1

            # The VM is gone: its GPU goes back too, with no relabel.
            held.unlink()
            assert wait_for(lambda: driver_of(host, HELD) == "nvidia")
            assert wait_for(lambda: agent.give_backs.held == set())
            assert "/dev/vfio/4" not in cdi_text(host)
            assert wait_for(lambda: events(api, "GpusGivenBack"))
            assert f"gave {HELD} back" in events(api, "GpusGivenBack")[0]["message"]

            relabel(api, "vm-passthrough")
            # The switch is logged once its reconcile has finished.
            assert wait_for(lambda: switch_lines(caplog, "workload switch container"))
            assert agent.target.steps.workload is Workload.VM_PASSTHROUGH
            assert driver_of(host, HELD) == driver_of(host, FREE) == "vfio-pci"
            assert host.path(WORKLOAD_TYPE).read_text() == "vm-passthrough\n"
            assert host.path(VFIO_READY).exists()
            assert "/dev/vfio/4" in cdi_text(host) and "/dev/vfio/5" in cdi_text(host)
            back = switch_lines(caplog, "workload switch container")
            assert len(back) == 1 and f"bound {HELD}, {FREE} to vfio-pci" in back[0]
            assert agent.metrics.registry.get_sample_value(
                "katamgr_workload_switches_total", {"from": "container", "to": "vm-passthrough"}) == 1
        finally:
            agent.request_stop()
            thread.join(timeout=15)
            watch.stop()
        assert not thread.is_alive()


def test_a_bad_label_value_keeps_the_workload_and_is_logged_once(tmp_path, caplog):
    host = make_host(tmp_path, [dev(FREE, GPU_A10, "nvidia", 5)])
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node",
                  "metadata": {"name": NODE, "labels": {WORKLOAD_LABEL: "vm-passthrough"}}})
        read, watch = follower(api)
        agent = make_agent(host, NAMING, Steps(kata=False), None, read_workload=read, node_watch=watch,
                      events=EventRecorder(api.client(), NODE))
        assert agent.reconcile("start").ok
        relabel(api, "vm-typo")
        assert wait_for(lambda: watch.labels().get(WORKLOAD_LABEL) == "vm-typo")
        assert agent.follow_workload() is False and agent.follow_workload() is False
        watch.stop()
        assert agent.target.steps.workload is Workload.VM_PASSTHROUGH and driver_of(host, FREE) == "vfio-pci"
        warnings = [r for r in caplog.records if "could not read the node's workload" in r.getMessage()]
        assert len(warnings) == 1 and "vm-typo" in warnings[0].getMessage()
        # And on the Node, where `kubectl describe node` shows it: once, a Warning.
        [refused] = events(api, "WorkloadLabelInvalid")
        assert refused["type"] == "Warning" and "'vm-typo'" in refused["message"]
        assert "nothing was moved: the node keeps vm-passthrough" in refused["message"]


def test_no_follower_without_auto_a_node_name_or_a_cluster():
    def followed(workload, node, api):
        return node_follower(api, node, workload=workload, default_workload=None,
                             fallback=lambda: (Workload.VM_PASSTHROUGH, "by hand"))

    assert followed("container", NODE, object()) is None
    assert followed("auto", None, object()) is None
    assert followed("auto", NODE, None) is None


def run_loop(agent: Agent) -> threading.Thread:
    thread = threading.Thread(target=agent.loop, daemon=True)
    thread.start()
    return thread


def stop_loop(agent: Agent, thread: threading.Thread, watch) -> None:
    agent.request_stop()
    thread.join(timeout=15)
    watch.stop()
    assert not thread.is_alive()


def test_a_gpu_is_given_back_within_seconds_of_its_vm_ending_with_a_long_check_interval(tmp_path):
    """A VM's end sends no event (its /dev/vfio fd closes in /proc): while a leave keeps GPUs
    for VMs, the agent looks at those GPUs every second between its full checks."""
    host = make_host(tmp_path, [dev(HELD, GPU_A10, "nvidia", 4), dev(FREE, GPU_A10, "nvidia", 5)])
    with followed_node(host, Steps(kata=False), check_interval=3600) as (api, agent, watch):
        assert agent.reconcile("start").ok and driver_of(host, HELD) == "vfio-pci"
        held = hold(host, 4)
        thread = run_loop(agent)
        try:
            relabel(api, "container")
            assert wait_for(lambda: agent.give_backs.held == {HELD}, timeout=5)
            assert driver_of(host, FREE) == "nvidia" and driver_of(host, HELD) == "vfio-pci"
            held.unlink()
            # An hour between full checks: only the poll of the held GPUs brings it back.
            assert wait_for(lambda: driver_now(host, HELD) == "nvidia", timeout=5)
            assert wait_for(lambda: agent.give_backs.held == set(), timeout=5)
        finally:
            stop_loop(agent, thread, watch)


def test_a_relabel_is_acted_on_within_seconds_with_a_long_check_interval(tmp_path):
    host = make_host(tmp_path, [dev(FREE, GPU_A10, "nvidia", 5)])
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node",
                  "metadata": {"name": NODE, "labels": {WORKLOAD_LABEL: "vm-passthrough"}}})
        read, watch = follower(api)
        # An hour between checks: only the watch can bring the relabel in time.
        agent = make_agent(host, NAMING, Steps(kata=False), None, check_interval=3600, repull_interval=7200,
                      read_workload=read, node_watch=watch)
        assert agent.reconcile("start").ok and driver_of(host, FREE) == "vfio-pci"
        thread = run_loop(agent)
        try:
            for workload, driver in (("container", "nvidia"), ("vm-passthrough", "vfio-pci")):
                started = time.monotonic()
                relabel(api, workload)
                assert wait_for(lambda: driver_now(host, FREE) == driver, timeout=5)  # noqa: B023
                assert time.monotonic() - started < 2.0, f"the switch to {workload} took too long"
            # Followed by a watch on this one Node, not by reading it again and again.
            assert api.watches("nodes")
            reads = [r for r in api.requests if r.method == "GET" and r.path == f"/api/v1/nodes/{NODE}"]
            assert len(reads) == 1
        finally:
            stop_loop(agent, thread, watch)


def short_host(devices):
    """A simulated node in a short temp dir: the kubelet's PodResources socket lives in it,
    and a unix socket path must fit in 107 bytes."""
    import tempfile

    return make_host(Path(tempfile.mkdtemp(prefix="ws-")), devices)


def pod_resources(host, pods):
    """The kubelet's PodResources v1 service on the node's socket, answering ``pods()``
    (nodesim.podresources, as the kubelet simulator serves it)."""
    server = PodResourcesServer(host.path(POD_RESOURCES_SOCKET), lambda: Snapshot(pods(), {}))
    server.start()
    return server


def test_a_gpu_given_to_a_pod_whose_vm_is_starting_stays_and_the_free_one_goes(caplog, monkeypatch):
    from katamgr.agent import giveback

    caplog.set_level("INFO", logger="katamgr.agent")
    host = short_host([dev(HELD, GPU_A10, "nvidia", 4), dev(FREE, GPU_A10, "nvidia", 5)])
    leaves = []
    real_leave = giveback.leave_passthrough

    def counted_leave(*args, **kwargs):
        leaves.append(kwargs.get("command"))
        return real_leave(*args, **kwargs)

    monkeypatch.setattr(giveback, "leave_passthrough", counted_leave)
    pods = [PodRecord("default", "vm-a", [ContainerRecord("cuda", {A10: [HELD.lower()]})])]
    server = pod_resources(host, lambda: list(pods))
    try:
        with followed_node(host, Steps(kata=False), events=True) as (api, agent, watch):
            assert agent.reconcile("start").ok
            thread = run_loop(agent)
            try:
                # The kubelet gave HELD to pod vm-a; its VM is still booting (no open node).
                # HELD stays for it; FREE, which nobody has, goes back at once.
                relabel(api, "container")
                assert wait_for(lambda: agent.target.steps.workload is Workload.CONTAINER)
                assert driver_of(host, HELD) == "vfio-pci" and driver_of(host, FREE) == "nvidia"
                assert agent.give_backs.held == {HELD}
                [line] = switch_lines(caplog)
                assert f"gave {FREE} back to their drivers" in line
                assert f"{HELD} (pod default/vm-a (container cuda, {A10}))" in line
                assert f"{HELD} not opened by its VM yet" in line
                assert len(leaves) == 1  # the switch's
                time.sleep(0.3)  # looked at every check (the kubelet asked), said once
                assert sum(r.getMessage().startswith("kept on vfio-pci:") for r in caplog.records) == 1
                assert "/dev/vfio/4" in cdi_text(host) and "/dev/vfio/5" not in cdi_text(host)
                # The VM is up and holds its GPU: it stays.
                vm = hold(host, 4)
                time.sleep(0.2)
                assert agent.give_backs.held == {HELD} and driver_of(host, HELD) == "vfio-pci"
                # The VM restarts (lets go for a moment) while its pod is still there: still the pod's.
                vm.unlink()
                time.sleep(0.2)
                vm = hold(host, 4, pid=7778)
                assert agent.give_backs.held == {HELD} and driver_of(host, HELD) == "vfio-pci"
                # Nothing let go all this while: no leave after the switch's (no node lock,
                # PCI scan or CDI check every check).
                assert len(leaves) == 1
                # Pod and VM gone: the last GPU goes back too, with no relabel.
                pods.clear()
                vm.unlink()
                assert wait_for(lambda: agent.give_backs.held == set())
                assert driver_of(host, HELD) == "nvidia"
                assert len(leaves) == 2
            finally:
                stop_loop(agent, thread, watch)
    finally:
        server.stop()


def test_a_pod_admitted_while_the_plugin_still_serves_keeps_its_gpu():
    """The leave asks the kubelet which pods hold GPUs only once it no longer offers them
    (PodResources GetAllocatableResources lists healthy devices only; a plugin that stood
    down has none: kubelet manager.go PluginDisconnected): a pod the kubelet admits in the
    moment between the relabel and the plugin standing down is in the answer and keeps
    its GPU, never given one that is leaving."""
    from katamgr.pipeline.reconcile import leave_passthrough
    from nodesim.podresources import ListedDevice

    host = short_host([dev(HELD, GPU_A10, "nvidia", 4), dev(FREE, GPU_A10, "nvidia", 5)])
    assert reconcile(host, NAMING, Steps(kata=False), None).ok
    pods: list[PodRecord] = []
    offered = {A10: [ListedDevice(HELD), ListedDevice(FREE)]}
    server = PodResourcesServer(host.path(POD_RESOURCES_SOCKET), lambda: Snapshot(list(pods), offered))
    server.start()
    try:
        left = []
        leave = threading.Thread(target=lambda: left.append(leave_passthrough(
            host, NAMING, Steps(kata=False, workload=Workload.CONTAINER), offer_wait=10)))
        started = time.monotonic()
        leave.start()
        time.sleep(0.3)
        assert not left and driver_of(host, FREE) == "vfio-pci"  # waiting: the plugin still serves
        # The kubelet admits a Kata pod onto HELD, then the plugin stands down.
        pods.append(PodRecord("default", "late", [ContainerRecord("main", {A10: [HELD.lower()]})]))
        offered[A10] = [ListedDevice(HELD, "Unhealthy"), ListedDevice(FREE, "Unhealthy")]
        leave.join(timeout=10)
        [report] = left
        assert time.monotonic() - started < 2
        assert driver_of(host, HELD) == "vfio-pci" and driver_of(host, FREE) == "nvidia"
        assert list(report.waiting) == [HELD] and "default/late" in report.waiting[HELD][0]
    finally:
        server.stop()


def test_a_gpu_the_kubelet_still_offers_stays_until_it_does_not():
    """A plugin that never stands down (or a label flipped back meanwhile): after the bounded
    wait the GPU the kubelet still offers to new pods stays on vfio-pci, reported, and goes
    back at a later look once it is not offered."""
    from katamgr.pipeline.reconcile import leave_passthrough
    from nodesim.podresources import ListedDevice

    host = short_host([dev(FREE, GPU_A10, "nvidia", 5)])
    assert reconcile(host, NAMING, Steps(kata=False), None).ok
    offered = {A10: [ListedDevice(FREE)]}
    server = PodResourcesServer(host.path(POD_RESOURCES_SOCKET), lambda: Snapshot([], offered))
    server.start()
    try:
        started = time.monotonic()
        container = Steps(kata=False, workload=Workload.CONTAINER)
        report = leave_passthrough(host, NAMING, container, offer_wait=0.5)
        assert 0.5 <= time.monotonic() - started < 3
        assert driver_of(host, FREE) == "vfio-pci" and list(report.held) == [FREE]
        assert any(f"{FREE} stay on vfio-pci: the kubelet still offers them" in w for w in report.warnings)
        # Waiting stops as soon as the node wants its GPUs bound again.
        started = time.monotonic()
        report = leave_passthrough(host, NAMING, container, offer_wait=10, cancelled=lambda: True)
        assert time.monotonic() - started < 2 and driver_of(host, FREE) == "vfio-pci"
        offered[A10] = []  # the plugin stood down at last
        report = leave_passthrough(host, NAMING, container, offer_wait=10)
        assert driver_of(host, FREE) == "nvidia" and report.restored == [FREE]
    finally:
        server.stop()


def test_a_kubelet_that_does_not_answer_is_a_bounded_wait_and_is_reported(tmp_path):
    import socket as sockets

    host = short_host([dev(FREE, GPU_A10, "nvidia", 5)])
    path = host.path(POD_RESOURCES_SOCKET)
    path.parent.mkdir(parents=True)
    # A kubelet that accepts the connection and never answers.
    hung = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    hung.bind(str(path))
    hung.listen(1)
    try:
        started = time.monotonic()
        asked = list_pod_devices(host, timeout=0.5)
        assert time.monotonic() - started < 3
        assert asked.assignments == () and "failed" in asked.unknown and POD_RESOURCES_SOCKET in asked.unknown
    finally:
        hung.close()
    # A socket file nobody serves (a kubelet that went away): refused at once.
    started = time.monotonic()
    asked = list_pod_devices(host, timeout=5)
    assert time.monotonic() - started < 3 and "UNAVAILABLE" in asked.unknown
    path.unlink()
    assert "does not exist" in list_pod_devices(host).unknown


def set_label(api, key: str, value: str | None) -> None:
    relabel(api, value, key=key)


def test_opting_out_of_the_vfio_manager_gives_gpus_back_and_lifting_it_binds_again(tmp_path, caplog):
    caplog.set_level("INFO", logger="katamgr.agent")
    host = make_host(tmp_path, [dev(FREE, GPU_A10, "nvidia", 5)])
    with followed_node(host, Steps(kata=False), events=True) as (api, agent, watch):
        assert agent.reconcile("start").ok and host.path(VFIO_READY).exists()
        thread = run_loop(agent)
        try:
            # As the GPU Operator's vfio-manager leaving the node unbinds (its preStop hook).
            set_label(api, Operand.VFIO_MANAGER.label, "false")
            assert wait_for(lambda: agent.target.opted_out == {Operand.VFIO_MANAGER})
            assert driver_of(host, FREE) == "nvidia"
            assert agent.target.steps.workload is Workload.VM_PASSTHROUGH and not agent.target.steps.vfio
            assert not host.path(VFIO_READY).exists()
            assert host.path(WORKLOAD_TYPE).read_text() == "vm-passthrough\n"
            assert "/dev/vfio/5" not in cdi_text(host)
            line = next(iter(switch_lines(caplog, "opt-outs now")))
            assert line.startswith("opt-outs now nvidia.com/gpu.deploy.vfio-manager=false (were none): "
                                   f"gave {FREE} back to their drivers")
            assert agent.metrics.registry.get_sample_value("katamgr_opted_out", {"operand": "vfio-manager"}) == 1
            assert wait_for(lambda: [e["message"] for e in events(api, "OptOutsChanged")] == [line])
            # A periodic reconcile does not bind while opted out.
            assert agent.reconcile("check").ok and driver_of(host, FREE) == "nvidia"

            set_label(api, Operand.VFIO_MANAGER.label, None)
            assert wait_for(lambda: host.path(VFIO_READY).exists())
            assert driver_of(host, FREE) == "vfio-pci"
            assert agent.metrics.registry.get_sample_value("katamgr_opted_out", {"operand": "vfio-manager"}) == 0
        finally:
            stop_loop(agent, thread, watch)


def test_opting_out_of_the_sandbox_validator_removes_the_readiness_files_only(tmp_path):
    host = make_host(tmp_path, [dev(FREE, GPU_A10, "nvidia", 5)])
    with followed_node(host, Steps(kata=False)) as (api, agent, watch):
        assert agent.reconcile("start").ok
        thread = run_loop(agent)
        try:
            set_label(api, Operand.SANDBOX_VALIDATOR.label, "false")
            assert wait_for(lambda: agent.target.opted_out == {Operand.SANDBOX_VALIDATOR})
            assert not host.path(WORKLOAD_TYPE).exists()
            assert not host.path(VFIO_READY).exists()
            assert driver_of(host, FREE) == "vfio-pci"  # the GPUs stay bound
            assert agent.reconcile("check").ok and not host.path(VFIO_READY).exists()
            set_label(api, Operand.SANDBOX_VALIDATOR.label, "true")  # the operator's own value
            assert wait_for(lambda: host.path(VFIO_READY).exists())
        finally:
            stop_loop(agent, thread, watch)


def test_all_operands_off_stands_every_step_down_and_kata_entries_stay(tmp_path):
    host = node(tmp_path)
    with followed_node(host, Steps(), ctx=KataContext(parse_config(CONFIG))) as (api, agent, watch):
        assert agent.reconcile("start").ok
        containerd = host.path("/etc/containerd/config.toml").read_text()
        thread = run_loop(agent)
        try:
            set_label(api, OPERANDS_LABEL, "false")
            assert wait_for(lambda: agent.target.opted_out == frozenset(Operand))
            assert driver_of(host, FREE) == driver_of(host, HELD) == "nvidia"
            assert not agent.target.steps.kata and not host.path(WORKLOAD_TYPE).exists()
            # The Kata entries stay for running VMs; with kata-manager opted out nothing
            # repairs them either: an edit someone makes is left alone.
            assert host.path("/etc/containerd/config.toml").read_text() == containerd
            assert agent.containerd_drift() is None
        finally:
            stop_loop(agent, thread, watch)


def test_a_gpu_busy_at_the_switch_to_passthrough_is_bound_once_its_process_lets_go(tmp_path, caplog):
    import shutil

    caplog.set_level("INFO", logger="katamgr.agent")
    host = make_host(tmp_path, [dev(HELD, GPU_A10, "nvidia", 4, minor=0), dev(FREE, GPU_A10, "nvidia", 5, minor=1)],
                     processes=[{"pid": 4242, "comm": "nvidia-device-plugin", "holds": ["/dev/nvidia0"]}])
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node",
                  "metadata": {"name": NODE, "labels": {WORKLOAD_LABEL: "container"}}})
        read, watch = follower(api)
        agent = make_agent(host, NAMING, Steps(kata=False, workload=Workload.CONTAINER), None, check_interval=0.05,
                      repull_interval=3600, read_workload=read, node_watch=watch)
        thread = run_loop(agent)
        try:
            relabel(api, "vm-passthrough")
            assert wait_for(lambda: driver_now(host, FREE) == "vfio-pci")
            # The container plugin leaving the node still holds HELD's /dev/nvidia0: skipped, named.
            assert wait_for(lambda: switch_lines(caplog, "workload switch container"))
            assert driver_of(host, HELD) == "nvidia"
            assert any("PID 4242 (nvidia-device-plugin)" in r.getMessage() for r in caplog.records)
            shutil.rmtree(host.path("/proc/4242"))  # it is gone
            assert wait_for(lambda: driver_now(host, HELD) == "vfio-pci", timeout=10)
            assert any("a GPU that was in use is free now" in r.getMessage() for r in caplog.records)
        finally:
            stop_loop(agent, thread, watch)


def agent_at_start(api, host, steps: Steps, ctx=None, **kw) -> tuple[Agent, object]:
    """A new `katamgr run --workload auto --node-name NODE` on a node katamgr set up earlier:
    the workload and opt-outs resolved from the labels at start, as cmd_run does."""
    read, watch = follower(api)
    now = read()
    agent = make_agent(host, NAMING, replace(steps, workload=now.workload), ctx, check_interval=0.05,
                  events=EventRecorder(api.client(), NODE), read_workload=read, node_watch=watch,
                  opted_out=now.opted_out, **kw)
    return agent, watch


def test_a_relabel_while_no_agent_ran_is_carried_out_by_the_first_reconcile(tmp_path, caplog):
    caplog.set_level("INFO", logger="katamgr.agent")
    host = node(tmp_path)
    ctx = KataContext(parse_config(CONFIG))
    # `katamgr apply` (or an earlier agent) on vm-passthrough...
    assert reconcile(host, NAMING, Steps(), ctx).ok
    assert driver_of(host, HELD) == driver_of(host, FREE) == "vfio-pci"
    containerd = host.path("/etc/containerd/config.toml").read_text()
    vm = hold(host, 4)  # ...a Kata VM runs on HELD...
    with FakeApiServer() as api:
        # ...and the node is relabeled while no agent runs (its pod deleted, say).
        api.seed({"apiVersion": "v1", "kind": "Node",
                  "metadata": {"name": NODE, "labels": {WORKLOAD_LABEL: "container"}}})
        agent, watch = agent_at_start(api, host, Steps(), ctx)
        assert agent.target.steps.workload is Workload.CONTAINER
        try:
            assert agent.reconcile("start").ok
            # The first reconcile did what the switch would have: the free GPU is back...
            assert driver_of(host, FREE) == "nvidia"
            # ...the VM's stays, reported, and is followed.
            assert driver_of(host, HELD) == "vfio-pci" and agent.give_backs.held == {HELD}
            assert host.path(WORKLOAD_TYPE).read_text() == "container\n"
            assert not host.path(VFIO_READY).exists()
            specs = cdi_text(host)
            assert "/dev/vfio/4" in specs and "/dev/vfio/5" not in specs
            assert host.path("/etc/containerd/config.toml").read_text() == containerd  # Kata entries stay
            [line] = switch_lines(caplog)
            assert line.startswith("workload switch vm-passthrough -> container, found at start")
            assert f"gave {FREE} back" in line and f"{HELD} (PID 7777 (qemu-system-x86)" in line
            assert not any("katamgr revert" in r.getMessage() and r.levelname == "WARNING"
                           for r in caplog.records)
            assert wait_for(lambda: [e["message"] for e in events(api, "WorkloadSwitched")] == [line])
            assert agent.metrics.registry.get_sample_value(
                "katamgr_workload_switches_total", {"from": "vm-passthrough", "to": "container"}) == 1
            # Another reconcile (the hourly check) has nothing new to give back or say.
            assert agent.reconcile("periodic artifact check").ok
            assert len(switch_lines(caplog)) == 1

            thread = run_loop(agent)
            try:
                vm.unlink()  # the VM is gone: its GPU goes back, with no relabel
                assert wait_for(lambda: driver_now(host, HELD) == "nvidia")
                assert wait_for(lambda: agent.give_backs.held == set())
                assert "/dev/vfio/4" not in cdi_text(host)
                assert agent.target.steps.workload is Workload.CONTAINER
            finally:
                agent.request_stop()
                thread.join(timeout=15)
                assert not thread.is_alive()
        finally:
            watch.stop()


def test_a_vfio_manager_opt_out_while_no_agent_ran_is_carried_out_at_start(tmp_path, caplog):
    caplog.set_level("INFO", logger="katamgr.agent")
    host = make_host(tmp_path, [dev(HELD, GPU_A10, "nvidia", 4), dev(FREE, GPU_A10, "nvidia", 5)])
    assert reconcile(host, NAMING, Steps(kata=False), None).ok
    vm = hold(host, 4)
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node",
                  "metadata": {"name": NODE, "labels": {WORKLOAD_LABEL: "vm-passthrough",
                                                        Operand.VFIO_MANAGER.label: "false"}}})
        agent, watch = agent_at_start(api, host, Steps(kata=False))
        assert agent.target.steps.passthrough and not agent.target.steps.vfio
        thread = None
        try:
            assert agent.reconcile("start").ok
            assert driver_of(host, FREE) == "nvidia" and driver_of(host, HELD) == "vfio-pci"
            assert agent.give_backs.held == {HELD}
            assert not host.path(VFIO_READY).exists()
            assert host.path(WORKLOAD_TYPE).read_text() == "vm-passthrough\n"
            specs = cdi_text(host)
            assert "/dev/vfio/4" in specs and "/dev/vfio/5" not in specs
            line = next(r.getMessage() for r in caplog.records if "opt-outs now" in r.getMessage())
            assert line.startswith("opt-outs now nvidia.com/gpu.deploy.vfio-manager=false, found at start")
            assert wait_for(lambda: [e["message"] for e in events(api, "OptOutsChanged")] == [line])
            thread = run_loop(agent)
            vm.unlink()
            assert wait_for(lambda: driver_now(host, HELD) == "nvidia")
            assert wait_for(lambda: agent.give_backs.held == set())
            assert "/dev/vfio/4" not in cdi_text(host)
        finally:
            if thread is not None:
                agent.request_stop()
                thread.join(timeout=15)
                assert not thread.is_alive()
            watch.stop()


def test_a_node_without_katamgr_records_is_left_as_it_was_at_start(tmp_path):
    host = make_host(tmp_path, [dev(FREE, GPU_A10, "nvidia", 5)])
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node",
                  "metadata": {"name": NODE, "labels": {WORKLOAD_LABEL: "container"}}})
        agent, watch = agent_at_start(api, host, Steps(kata=False))
        try:
            report = agent.reconcile("start")
            assert report.ok and report.changes == []
            assert not host.path(WORKLOAD_TYPE).exists() and driver_of(host, FREE) == "nvidia"
            assert not events(api, "WorkloadSwitched")
        finally:
            watch.stop()


def test_a_switch_and_a_give_back_keep_the_agent_healthy_however_long(tmp_path, monkeypatch):
    from katamgr.agent import giveback, health

    host = make_host(tmp_path, [dev(HELD, GPU_A10, "nvidia", 4), dev(FREE, GPU_A10, "nvidia", 5)])
    agent = make_agent(host, NAMING, Steps(kata=False), None, check_interval=0.05)
    assert agent.reconcile("start").ok
    seen: list[tuple[bool, str]] = []
    real = giveback.leave_passthrough

    def slow_leave(*args, **kwargs):
        # The loop last ticked long ago (a slow unbind, a kubelet that takes its time):
        # only the busy mark keeps /healthz good.
        agent.probes.last_tick = time.monotonic() - 10 * health.STALE_AFTER
        seen.append(agent.health())
        return real(*args, **kwargs)

    monkeypatch.setattr(giveback, "leave_passthrough", slow_leave)
    vm = hold(host, 4)
    assert agent.switch(Workload.CONTAINER, frozenset())
    assert seen and seen[-1][0] is True and seen[-1][1].startswith("switching the workload for ")
    assert agent.health()[0] is True  # and the loop counts as ticked once it is done
    assert agent.give_backs.held == {HELD}
    vm.unlink()
    agent.release_freed()
    assert len(seen) == 2 and seen[-1][0] is True and seen[-1][1].startswith("giving back GPUs for ")
    assert agent.give_backs.held == set() and driver_of(host, HELD) == "nvidia"
    # Without the mark the same pause fails /healthz (what the probe would restart).
    agent.probes.last_tick = time.monotonic() - 10 * health.STALE_AFTER
    assert agent.health()[0] is False


def test_an_opt_out_change_on_a_container_node_keeps_following_a_held_gpu(tmp_path):
    host = make_host(tmp_path, [dev(HELD, GPU_A10, "nvidia", 4)])
    with followed_node(host, Steps(kata=False)) as (api, agent, watch):
        assert agent.reconcile("start").ok
        vm = hold(host, 4)
        thread = run_loop(agent)
        try:
            relabel(api, "container")
            assert wait_for(lambda: agent.target.steps.workload is Workload.CONTAINER)
            assert agent.give_backs.held == {HELD}
            # A change that gives nothing back (the readiness files' opt-out) forgets nothing.
            set_label(api, Operand.SANDBOX_VALIDATOR.label, "false")
            assert wait_for(lambda: agent.target.opted_out == {Operand.SANDBOX_VALIDATOR})
            assert agent.give_backs.held == {HELD}
            vm.unlink()
            assert wait_for(lambda: driver_now(host, HELD) == "nvidia")
        finally:
            stop_loop(agent, thread, watch)
