"""``katamgr run`` follows its Node's ``nvidia.com/gpu.workload.config`` label without a
restart: vm-passthrough -> container gives the free GPUs back and keeps (and reports)
the ones a running VM holds; container -> vm-passthrough binds again."""

from __future__ import annotations

import argparse
import threading
import time

from support.apiserver import FakeApiServer
from support.hostkit import GPU_A10, dev, driver_of, make_host
from support.paths import REPO

from katamgr.agent import Agent
from katamgr.cli import _workload_follower
from katamgr.cluster import EventRecorder
from katamgr.config import parse_config
from katamgr.host.naming import Naming
from katamgr.host.pciids import PciIds
from katamgr.host.readiness import VFIO_READY, WORKLOAD_TYPE
from katamgr.host.workload import WORKLOAD_LABEL, Workload
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.reconcile import Steps

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


def relabel(api: FakeApiServer, workload: str) -> None:
    api.update("nodes", NODE, lambda n: n["metadata"].setdefault("labels", {}).__setitem__(WORKLOAD_LABEL, workload))


def wait_for(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def cdi_text(host) -> str:
    spec_dir = host.path("/var/run/cdi")
    return "".join(p.read_text() for p in sorted(spec_dir.glob("*"))) if spec_dir.is_dir() else ""


def test_relabel_gives_free_gpus_back_keeps_held_ones_and_binds_again(tmp_path, caplog):
    caplog.set_level("INFO", logger="katamgr.agent")
    host = node(tmp_path)
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node",
                  "metadata": {"name": NODE, "labels": {WORKLOAD_LABEL: "vm-passthrough"}}})
        client = api.client()
        args = argparse.Namespace(workload="auto", node_name=NODE, default_workload="container")
        read = _workload_follower(args, client)
        assert read is not None and read() is Workload.VM_PASSTHROUGH
        agent = Agent(host, NAMING, Steps(), KataContext(parse_config(CONFIG)), check_interval=0.05,
                      events=EventRecorder(client, NODE), read_workload=read)
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
            assert wait_for(lambda: agent.steps.workload is Workload.CONTAINER)
            # The free GPU went back to its driver; the one the VM holds stayed and is reported.
            assert driver_of(host, FREE) == "nvidia"
            assert driver_of(host, HELD) == "vfio-pci"
            assert agent.held == {HELD}
            assert host.path(WORKLOAD_TYPE).read_text() == "container\n"
            assert not host.path(VFIO_READY).exists()
            specs = cdi_text(host)
            assert "/dev/vfio/4" in specs and "/dev/vfio/5" not in specs  # the specs follow
            # The Kata runtime entries stay (running VMs use them).
            assert host.path("/etc/containerd/config.toml").read_text() == containerd
            switches = [r.getMessage() for r in caplog.records if "workload switch" in r.getMessage()]
            assert len(switches) == 1
            line = switches[0]
            assert line.startswith("workload switch vm-passthrough -> container: ")
            assert f"gave {FREE} back" in line and f"{HELD} (PID 7777 (qemu-system-x86)" in line
            assert "Kata runtime entries in containerd stay" in line
            events = [api.get("events", n, "default") for n in api.names("events")]
            switched = [e for e in events if e["reason"] == "WorkloadSwitched"]
            assert len(switched) == 1 and switched[0]["message"] == line
            assert agent.metrics.registry.get_sample_value(
                "katamgr_workload_switches_total", {"from": "vm-passthrough", "to": "container"}) == 1

            # The VM is gone: its GPU goes back too, with no relabel.
            held.unlink()
            assert wait_for(lambda: driver_of(host, HELD) == "nvidia")
            assert wait_for(lambda: agent.held == set())
            assert "/dev/vfio/4" not in cdi_text(host)

            relabel(api, "vm-passthrough")
            # The switch is logged once its reconcile has finished.
            assert wait_for(lambda: any("workload switch container" in r.getMessage() for r in caplog.records))
            assert agent.steps.workload is Workload.VM_PASSTHROUGH
            assert driver_of(host, HELD) == driver_of(host, FREE) == "vfio-pci"
            assert host.path(WORKLOAD_TYPE).read_text() == "vm-passthrough\n"
            assert host.path(VFIO_READY).exists()
            assert "/dev/vfio/4" in cdi_text(host) and "/dev/vfio/5" in cdi_text(host)
            back = [r.getMessage() for r in caplog.records if "workload switch container" in r.getMessage()]
            assert len(back) == 1 and f"bound {HELD}, {FREE} to vfio-pci" in back[0]
            assert agent.metrics.registry.get_sample_value(
                "katamgr_workload_switches_total", {"from": "container", "to": "vm-passthrough"}) == 1
        finally:
            agent.request_stop()
            thread.join(timeout=15)
        assert not thread.is_alive()


def test_a_bad_label_value_keeps_the_workload_and_is_logged_once(tmp_path, caplog):
    host = make_host(tmp_path, [dev(FREE, GPU_A10, "nvidia", 5)])
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node",
                  "metadata": {"name": NODE, "labels": {WORKLOAD_LABEL: "vm-passthrough"}}})
        args = argparse.Namespace(workload="auto", node_name=NODE, default_workload="container")
        agent = Agent(host, NAMING, Steps(kata=False), None,
                      read_workload=_workload_follower(args, api.client()))
        assert agent.reconcile("start").ok
        relabel(api, "vm-typo")
        assert agent.follow_workload() is False and agent.follow_workload() is False
        assert agent.steps.workload is Workload.VM_PASSTHROUGH and driver_of(host, FREE) == "vfio-pci"
        warnings = [r for r in caplog.records if "could not read the node's workload" in r.getMessage()]
        assert len(warnings) == 1 and "vm-typo" in warnings[0].getMessage()


def test_no_follower_without_auto_a_node_name_or_a_cluster():
    assert _workload_follower(argparse.Namespace(workload="container", node_name=NODE), object()) is None
    assert _workload_follower(argparse.Namespace(workload="auto", node_name=None), object()) is None
    assert _workload_follower(argparse.Namespace(workload="auto", node_name=NODE), None) is None
