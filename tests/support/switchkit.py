"""The workload-switch tests' node and cluster (tests/pipeline/test_workload_*.py): a simulated
node with two A10s, an API server holding its Node, an Agent following that Node's labels as
``katamgr run --workload auto --node-name NODE`` does, and what a test reads back (the switch's
log lines, the Node's Events, the CDI specs, a driver mid-move)."""

from __future__ import annotations

import contextlib
import shutil
import threading

from gpunode.host.pciids import PciIds
from gpunode.policy.naming import Naming
from gpunode.policy.workload import WORKLOAD_LABEL, Workload
from katamgr.agent import Agent
from katamgr.agent.following import node_follower
from katamgr.cluster import EventRecorder
from katamgr.pipeline.reconcile import Steps
from support.agentkit import make_agent
from support.apiserver import FakeApiServer
from support.hostkit import GPU_A10, dev, driver_of, make_host
from support.paths import REPO

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


def kata_node(tmp_path):
    """Both GPUs on nvidia, with the demo's containerd config and Kata's OCI layout in place
    (what the Kata runtime step installs from)."""
    host = make_host(tmp_path, [dev(HELD, GPU_A10, "nvidia", 4), dev(FREE, GPU_A10, "nvidia", 5)])
    host.path("/etc/containerd").mkdir(parents=True)
    host.path("/etc/containerd/config.toml").write_text(
        (REPO / "katamgr" / "data" / "demo" / "containerd-config.toml").read_text())
    shutil.copytree(REPO / "katamgr" / "data" / "oci-layout", host.path("/opt/kata-artifacts/layout"))
    return host


def relabel(api: FakeApiServer, workload: str | None, key: str = WORKLOAD_LABEL) -> None:
    """Set (None: remove) one of the Node's labels, as `kubectl label node` does."""
    def change(n):
        labels = n["metadata"].setdefault("labels", {})
        if workload is None:
            labels.pop(key, None)
        else:
            labels[key] = workload
    api.update("nodes", NODE, change)


def follower(api: FakeApiServer, splits=()):
    """What `katamgr run --workload auto --node-name NODE` follows, its watch started (``splits``:
    the config's split per node pool)."""
    followed = node_follower(api.client(), NODE, workload="auto", default_workload="container",
                             fallback=lambda: (Workload.VM_PASSTHROUGH, "by hand"), splits=splits)
    return followed.read, followed.watch.start()


@contextlib.contextmanager
def followed_node(host, steps: Steps, *, ctx=None, label: str = "vm-passthrough", events: bool = False,
                  check_interval: float = 0.05, splits=(), naming: Naming = NAMING):
    """An API server holding the Node labeled ``label``, and an Agent following it as
    ``katamgr run --workload auto`` does (its loop not started): (api, agent, watch)."""
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node",
                  "metadata": {"name": NODE, "labels": {WORKLOAD_LABEL: label}}})
        read, watch = follower(api, splits)
        agent = make_agent(host, naming, steps, ctx, check_interval=check_interval,
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


def run_loop(agent: Agent) -> threading.Thread:
    thread = threading.Thread(target=agent.loop, daemon=True)
    thread.start()
    return thread


def stop_loop(agent: Agent, thread: threading.Thread, watch) -> None:
    agent.request_stop()
    thread.join(timeout=15)
    watch.stop()
    assert not thread.is_alive()
