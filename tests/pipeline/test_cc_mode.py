"""The node's CC mode kept as ``nvidia.com/cc.mode`` asks, on simulated nodes, as NVIDIA's
k8s-cc-manager keeps it: label ``on`` -> the GPUs switched in one batch, read back, state
labels published, confidential (``-snp``) pods schedulable; a held GPU delays the switch
without harm; ``off`` back; a failing tool or a read-back that differs leaves
``cc.mode.state=failed``, nothing CC-ready, and the GPUs bound for passthrough as before.
The modes live in the emulated kernel (``nodesim.gpu``): staged, applied at the
device's reset, read back after it."""

from __future__ import annotations

import json
import threading
import time

from support.agentkit import make_agent
from support.apiserver import FakeApiServer
from support.hostkit import hold

from gpunode.host.cc import MODE_LABEL, MODE_STATE_LABEL, READY_STATE_LABEL, CcMode
from gpunode.host.pci import scan
from gpunode.host.pciids import PciIds
from gpunode.kataclasses import OFFER_LABEL_PREFIX
from gpunode.policy.naming import Naming
from gpunode.policy.selection import Selection
from gpunode.policy.workload import WORKLOAD_LABEL, Workload
from katamgr.agent.following import node_follower
from katamgr.cluster import EventRecorder, set_node_labels
from katamgr.cluster.runtimeclasses import desired_runtime_classes
from katamgr.config import default_config
from katamgr.pipeline import ccmode
from katamgr.pipeline.reconcile import Steps, reconcile
from nodesim.marker import MARKER
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

# The NVSwitches passed through (--nvswitches true): PPCIe mode gives them to the one VM.
# (By default they stay on the host: Kata before 4.1 fails a sandbox given one, tests/kata.)
NAMING = Naming(PciIds.find(), selection=Selection(nvswitches=True))
NODE = "dgx-1"
GPUS = ["0000:03:00.0", "0000:04:00.0", "0000:13:00.0", "0000:14:00.0",
        "0000:83:00.0", "0000:84:00.0", "0000:93:00.0", "0000:94:00.0"]
NVSWITCHES = ["0000:05:00.0", "0000:15:00.0", "0000:85:00.0", "0000:95:00.0"]


def simulated(tmp_path, profile="dgx-h100"):
    host = materialise(find_profile(profile), tmp_path / "host")
    assert reconcile(host, NAMING, Steps(kata=False), None).ok
    return host


def modes(host) -> dict[str, dict]:
    return json.loads((host.root / MARKER).read_text())["cc"]


def tune(host, **faults) -> None:
    data = json.loads((host.root / MARKER).read_text())
    data["cc_faults"].update(faults)
    (host.root / MARKER).write_text(json.dumps(data))


def drivers(host) -> dict[str, str | None]:
    return {d.bdf: d.driver for d in scan(host) if d.is_gpu or d.is_nvswitch}


def wait_for(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_switch_on_then_ppcie_then_off_in_one_batch_each(tmp_path):
    host = simulated(tmp_path)
    before = drivers(host)
    assert set(before.values()) == {"vfio-pci"}
    report = ccmode.switch(host, NAMING, CcMode.ON)
    assert report.ok and report.state == "on"
    assert report.switched == GPUS  # the GPUs, not the NVSwitches
    assert all(modes(host)[g]["cc"] == "on" for g in GPUS)
    assert drivers(host) == before  # bound back for passthrough
    assert all(host.path(f"/dev/vfio/{n}").exists() for n in (6, 8))
    again = ccmode.switch(host, NAMING, CcMode.ON)
    assert again.ok and again.state == "on" and again.switched == []  # nothing reset twice
    ppcie = ccmode.switch(host, NAMING, CcMode.PPCIE)
    assert ppcie.state == "ppcie" and sorted(ppcie.switched) == sorted(GPUS + NVSWITCHES)
    assert all(modes(host)[d]["ppcie"] == "on" for d in GPUS + NVSWITCHES)
    assert all(modes(host)[g]["cc"] == "off" for g in GPUS)
    off = ccmode.switch(host, NAMING, CcMode.OFF)
    assert off.state == "off" and sorted(off.switched) == sorted(GPUS + NVSWITCHES)
    assert drivers(host) == before


def test_a_failing_tool_leaves_failed_and_the_gpus_bound_as_before(tmp_path):
    host = simulated(tmp_path)
    before = drivers(host)
    tune(host, stage=[GPUS[5]])
    report = ccmode.switch(host, NAMING, CcMode.ON)
    assert report.state == "failed"
    assert any(GPUS[5] in f and "FSP" in f for f in report.failures)
    assert drivers(host) == before
    # Nothing was reset, and the GPUs staged before the failure were staged back.
    assert all(modes(host)[g]["cc"] == "off" for g in GPUS)
    assert all(modes(host)[g].get("staged", {}).get("cc") in (None, "off") for g in GPUS)


def test_a_read_back_that_differs_is_failed(tmp_path):
    host = simulated(tmp_path)
    tune(host, readback={GPUS[2]: "off"})
    report = ccmode.switch(host, NAMING, CcMode.ON)
    assert report.state == "failed"
    assert any(f.startswith(f"{GPUS[2]} was reset into CC mode on but reads back off") for f in report.failures)
    assert set(drivers(host).values()) == {"vfio-pci"}


def test_a_held_gpu_keeps_the_switch_waiting(tmp_path):
    host = simulated(tmp_path)
    held = hold(host, 6, pid=4242)
    report = ccmode.switch(host, NAMING, CcMode.ON)
    assert report.waiting and report.state == "" and report.switched == []
    assert "0000:03:00.0 is held by PID 4242 (qemu-system-x86)" in report.warnings[0]
    assert all(modes(host)[g]["cc"] == "off" for g in GPUS)  # not one GPU touched
    held.unlink()
    assert ccmode.switch(host, NAMING, CcMode.ON).state == "on"


def test_gpus_that_are_not_cc_capable(tmp_path):
    host = simulated(tmp_path, "a10-server")
    node = ccmode.look(host, NAMING, CcMode.ON)
    assert node.devices == () and node.state == "off"  # no CC-capable GPU: off, never CC-ready
    report = ccmode.switch(host, NAMING, CcMode.ON)
    assert report.ok and report.state == "off" and report.switched == []


def test_grace_hopper_keeps_its_variant_driver_across_a_switch(tmp_path):
    host = simulated(tmp_path, "gh200")
    assert drivers(host) == {"0009:01:00.0": "nvgrace_gpu_vfio_pci"}
    assert ccmode.switch(host, NAMING, CcMode.ON).state == "on"
    assert drivers(host) == {"0009:01:00.0": "nvgrace_gpu_vfio_pci"}


def _seed(api, labels):
    api.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": labels}})


def _labels(api) -> dict[str, str]:
    return api.get("nodes", NODE)["metadata"].get("labels", {})


def _events(api, reason):
    found = [api.get("events", n, "default") for n in api.names("events")]
    return [e for e in found if e and e["reason"] == reason]


def test_the_agent_follows_the_label_publishes_state_and_waits_for_held_gpus(tmp_path):
    host = simulated(tmp_path)
    with FakeApiServer() as api:
        _seed(api, {WORKLOAD_LABEL: "vm-passthrough"})
        client = api.client()
        followed = node_follower(client, NODE, workload="auto", default_workload="container",
                                 fallback=lambda: (Workload.VM_PASSTHROUGH, "by hand"))
        read, watch = followed.read, followed.watch.start()
        agent = make_agent(host, NAMING, Steps(kata=False), None, check_interval=0.05,
                      events=EventRecorder(client, NODE), read_workload=read, node_watch=watch,
                      cc_default_mode=CcMode.OFF, read_labels=watch.labels,
                      publish_labels=lambda labels: set_node_labels(client, NODE, labels))
        assert agent.reconcile("start").ok
        # Unlabeled: the default (off), which the GPUs already run; the state is published.
        assert agent.follow_cc() is False
        assert wait_for(lambda: _labels(api).get(MODE_STATE_LABEL) == "off")
        assert _labels(api)[READY_STATE_LABEL] == "false"
        thread = threading.Thread(target=agent.loop, daemon=True)
        thread.start()
        try:
            api.update("nodes", NODE, lambda n: n["metadata"]["labels"].__setitem__(MODE_LABEL, "on"))
            assert wait_for(lambda: _labels(api).get(MODE_STATE_LABEL) == "on")
            assert _labels(api)[READY_STATE_LABEL] == "true"
            assert all(modes(host)[g]["cc"] == "on" for g in GPUS)
            assert set(drivers(host).values()) == {"vfio-pci"}
            assert wait_for(lambda: len(_events(api, "CcModeSwitched")) == 1)
            assert agent.metrics.registry.get_sample_value(
                "katamgr_cc_mode_switches_total", {"mode": "on", "result": "success"}) == 1
            # A -snp pod's RuntimeClass now selects this node.
            snp = next(b for b in desired_runtime_classes(default_config()) if b["metadata"]["name"].endswith("-snp"))
            selector = snp["scheduling"]["nodeSelector"]
            assert selector[READY_STATE_LABEL] == "true"
            # (the class's own offer label is the Kata step's, off in this agent)
            assert all(_labels(api).get(k) == v for k, v in selector.items()
                       if k not in ("nvidia.com/cc.capable",) and not k.startswith(OFFER_LABEL_PREFIX))

            # A VM holds one GPU: off waits (no GPU touched), not CC-ready meanwhile, said once.
            held = hold(host, 6, pid=4242)
            api.update("nodes", NODE, lambda n: n["metadata"]["labels"].__setitem__(MODE_LABEL, "off"))
            assert wait_for(lambda: _labels(api).get(READY_STATE_LABEL) == "false")
            assert wait_for(lambda: len(_events(api, "CcModeSwitchWaiting")) == 1)
            assert "0000:03:00.0 is held by PID 4242" in _events(api, "CcModeSwitchWaiting")[0]["message"]
            assert all(modes(host)[g]["cc"] == "on" for g in GPUS)
            assert _labels(api)[MODE_STATE_LABEL] == "on"
            held.unlink()
            assert wait_for(lambda: _labels(api).get(MODE_STATE_LABEL) == "off")
            assert all(modes(host)[g]["cc"] == "off" for g in GPUS)

            # The tool fails: failed, nothing CC-ready, the GPUs bound as before; not retried.
            tune(host, stage=[GPUS[1]])
            api.update("nodes", NODE, lambda n: n["metadata"]["labels"].__setitem__(MODE_LABEL, "on"))
            assert wait_for(lambda: _labels(api).get(MODE_STATE_LABEL) == "failed")
            assert _labels(api)[READY_STATE_LABEL] == ""
            assert set(drivers(host).values()) == {"vfio-pci"}
            assert wait_for(lambda: len(_events(api, "CcModeSwitchFailed")) == 1)
            assert _events(api, "CcModeSwitchFailed")[0]["type"] == "Warning"
            assert agent.metrics.registry.get_sample_value(
                "katamgr_cc_mode_switches_total", {"mode": "on", "result": "failure"}) == 1
        finally:
            agent.request_stop()
            thread.join(timeout=15)
            watch.stop()
        assert not thread.is_alive()


def test_a_held_gpu_is_never_read_and_a_node_already_in_mode_is_left_alone(tmp_path):
    """NVIDIA's tool maps a GPU's BAR and writes to it: never to a GPU a VM runs on. A node
    whose readable GPUs already run the wanted mode is reported unverified, not switched."""
    host = simulated(tmp_path)
    assert ccmode.switch(host, NAMING, CcMode.ON).state == "on"
    hold(host, 6, pid=4242)
    seen: list[str] = []

    class Watching:
        def __init__(self, inner):
            self.inner = inner

        def query(self, h, bdf):
            seen.append(bdf)
            return self.inner.query(h, bdf)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    import nodesim.kernel as simkernel
    from nodesim.gpu import EMULATED_GPU_ADMIN

    original = simkernel.EmulatedKernel.gpu_admin
    simkernel.EmulatedKernel.gpu_admin = lambda self: Watching(EMULATED_GPU_ADMIN)
    try:
        report = ccmode.switch(host, NAMING, CcMode.ON)
    finally:
        simkernel.EmulatedKernel.gpu_admin = original
    assert "0000:03:00.0" not in seen and "0000:04:00.0" in seen
    assert report.unverified == {"0000:03:00.0": "PID 4242 (qemu-system-x86) holding /dev/vfio/6"}
    assert not report.waiting and report.switched == [] and report.state == ""


def test_cc_ready_waits_until_the_kubelet_advertises_the_gpus_again(tmp_path):
    """Seen on the real kubelet (tests/node/test_node_cc.py): right after a switch the device
    plugin still has the GPUs Unhealthy (they were unbound), and a confidential pod the
    scheduler placed then is refused by the kubelet. cc.ready.state=true waits for the Node's
    allocatable count to be whole again."""
    host = simulated(tmp_path)
    published: list[dict] = []
    status = {"capacity": {"nvidia.com/GH100H100_SXM5_80GB": "8"},
              "allocatable": {"nvidia.com/GH100H100_SXM5_80GB": "0"}}
    labels = {WORKLOAD_LABEL: "vm-passthrough", MODE_LABEL: "on"}

    def publish(change):
        published.append(dict(change))
        labels.update(change)

    agent = make_agent(host, NAMING, Steps(kata=False), None, cc_default_mode=CcMode.OFF,
                  read_labels=lambda: labels, publish_labels=publish,
                  read_resources=lambda: (status["capacity"], status["allocatable"]))
    assert agent.follow_cc() is True
    assert labels[MODE_STATE_LABEL] == "on" and labels[READY_STATE_LABEL] == "false"
    status["allocatable"]["nvidia.com/GH100H100_SXM5_80GB"] = "8"  # the plugin reports them healthy
    assert agent.follow_cc() is False
    assert labels[READY_STATE_LABEL] == "true"


def test_cc_ready_waits_for_the_kubelets_own_view_when_the_node_status_is_behind():
    """The Node's allocatable is the kubelet's report at its last status sync (every 10 s), so
    right after a short switch it can still read whole from before the GPUs went Unhealthy;
    a pod placed then was refused on the real kubelet (tests/node/test_node_cc.py). The
    kubelet's PodResources GetAllocatableResources lists only the devices its device manager
    holds healthy now (pkg/kubelet/cm/devicemanager GetAllocatableDevices): ready waits for
    every GPU there too."""
    import tempfile
    from pathlib import Path

    from gpunode.services.podresources import POD_RESOURCES_SOCKET
    from nodesim.podresources import ListedDevice, PodResourcesServer, Snapshot

    host = simulated(Path(tempfile.mkdtemp(prefix="cc-")))  # a unix socket path fits 107 bytes
    gpu = "nvidia.com/GH100H100_SXM5_80GB"
    status = {"capacity": {gpu: "8"}, "allocatable": {gpu: "8"}}  # whole: from before the switch
    health = {bdf: "Unhealthy" for bdf in GPUS}
    labels = {WORKLOAD_LABEL: "vm-passthrough", MODE_LABEL: "on"}
    server = PodResourcesServer(host.path(POD_RESOURCES_SOCKET), lambda: Snapshot(
        [], {gpu: [ListedDevice(bdf, health[bdf]) for bdf in GPUS]}))
    server.start()
    try:
        agent = make_agent(host, NAMING, Steps(kata=False), None, cc_default_mode=CcMode.OFF,
                      read_labels=lambda: labels, publish_labels=labels.update,
                      read_resources=lambda: (status["capacity"], status["allocatable"]))
        assert agent.follow_cc() is True
        assert labels[MODE_STATE_LABEL] == "on" and labels[READY_STATE_LABEL] == "false"
        health.update({bdf: "Healthy" for bdf in GPUS[:7]})
        agent.follow_cc()
        assert labels[READY_STATE_LABEL] == "false"  # one GPU still Unhealthy at the kubelet
        health[GPUS[7]] = "Healthy"
        agent.follow_cc()
        assert labels[READY_STATE_LABEL] == "true"
    finally:
        server.stop()
