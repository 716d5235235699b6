"""``katamgr run`` as an operator watches it: a failed reconcile retried with backoff
(not on the hourly artifact timer), ``/metrics``, ``/healthz`` and ``/readyz`` over
HTTP, and Events on the Node through the API stand-in."""

from __future__ import annotations

import shutil
import threading
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from support.agentkit import make_agent
from support.apiserver import FakeApiServer
from support.hostkit import GPU_A10, dev, make_host
from support.kataconfig import kata_manager_yaml, prepare_node
from support.paths import REPO
from support.waiting import wait_for

from gpunode.host.pciids import PciIds
from gpunode.policy.naming import Naming
from katamgr.agent.events import NodeEvents
from katamgr.cluster import EventRecorder
from katamgr.config import parse_config
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.reconcile import Steps

LAYOUT = REPO / "katamgr" / "data" / "oci-layout"
NAMING = Naming(PciIds.find())
# The layout is not on the node at first (a copy still under way, a mirror not synced).
LATE = kata_manager_yaml(layout="/opt/kata-artifacts/late")


def node(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4), dev("0000:02:00.0", GPU_A10, "nvidia", 5)])
    return prepare_node(host, layout=False)


def publish_layout(host) -> None:
    shutil.copytree(LAYOUT, host.path("/opt/kata-artifacts/late"))


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(port: int) -> dict[str, list]:
    status, text = get(port, "/metrics")
    assert status == 200
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def value(samples, name: str, **labels) -> float:
    found = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert found, (name, labels, samples)
    return sum(found)


def test_a_failed_pull_is_retried_within_seconds_and_readyz_follows(tmp_path):
    host = node(tmp_path)
    # The artifact timer is an hour away: only the retry backoff can bring the pull back.
    agent = make_agent(host, NAMING, Steps(), KataContext(parse_config(LATE)), repull_interval=3600,
                  retry_initial=0.1, retry_max=0.4)
    server = agent.serve_metrics("127.0.0.1:0")
    try:
        assert get(server.port, "/readyz")[0] == 503  # nothing reconciled yet
        assert get(server.port, "/healthz")[0] == 200
        first = agent.reconcile("start")
        # Only the class failed: the GPUs are bound and the CDI spec written all the same.
        assert first.partly and first.failures == [] and "late" in first.classes_failed["kata-qemu-nvidia-gpu"]
        assert sorted(first.moved) == ["0000:01:00.0", "0000:02:00.0"]
        assert host.path("/var/run/cdi").is_dir()
        status, body = get(server.port, "/readyz")
        assert status == 503 and "runtime class(es) kata-qemu-nvidia-gpu failed and are not offered" in body
        assert value(scrape(server.port)["katamgr_runtime_class_ready"], "katamgr_runtime_class_ready",
                     runtime_class="kata-qemu-nvidia-gpu") == 0
        assert agent.reconciler.retry_delay == 0.1
        thread = threading.Thread(target=agent.loop, daemon=True)
        thread.start()
        try:
            # It keeps failing, backing off (0.1, 0.2, 0.4, 0.4 ...) but never waiting an hour.
            assert wait_for(lambda: agent.reconciler.reconciles >= 4)
            assert agent.reconciler.retry_delay == 0.4
            metrics = scrape(server.port)
            assert value(metrics["katamgr_reconciles"], "katamgr_reconciles_total", result="partial") >= 4
            assert value(metrics["katamgr_reconcile_errors"], "katamgr_reconcile_errors_total") >= 4
            publish_layout(host)
            assert wait_for(lambda: agent.reconciler.last_result is not None and agent.reconciler.last_result.ok)
            assert agent.reconciler.retry_delay is None and agent.reconciler.retry_at is None  # the backoff is reset
            # Ready once the verification that follows the reconcile has written its verdict.
            wait_for(lambda: get(server.port, "/readyz")[0] == 200, "/readyz 200 after the verification")
            settled = agent.reconciler.reconciles
            time.sleep(0.6)
            assert agent.reconciler.reconciles == settled  # no retries after a success
            assert get(server.port, "/healthz")[0] == 200
        finally:
            agent.request_stop()
            thread.join(timeout=15)
        assert not thread.is_alive()
        metrics = scrape(server.port)
    finally:
        server.stop()
    assert "kata-qemu-nvidia-gpu" in host.path("/etc/containerd/config.toml").read_text()
    assert value(metrics["katamgr_reconciles"], "katamgr_reconciles_total", result="success") == 1
    assert value(metrics["katamgr_reconcile_duration_seconds"], "katamgr_reconcile_duration_seconds_count") \
        == agent.reconciler.reconciles
    assert value(metrics["katamgr_last_successful_reconcile_timestamp_seconds"],
                 "katamgr_last_successful_reconcile_timestamp_seconds") > time.time() - 120
    assert value(metrics["katamgr_artifact_pulled_bytes"], "katamgr_artifact_pulled_bytes_total") > 0
    assert value(metrics["katamgr_devices"], "katamgr_devices", kind="gpu", driver="vfio-pci", action="keep") == 2
    assert metrics["katamgr_iommu_groups_skipped"] == []
    assert value(metrics["katamgr_runtime_class_ready"], "katamgr_runtime_class_ready",
                 runtime_class="kata-qemu-nvidia-gpu") == 1


def test_healthz_fails_when_the_loop_stops_ticking(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4)])
    agent = make_agent(host, NAMING, Steps(kata=False), None, check_interval=0.05)
    agent.reconcile("start")
    with agent.serve_metrics("127.0.0.1:0") as server:
        assert get(server.port, "/healthz")[0] == 200
        agent.probes.last_tick -= 3600  # as if the loop hung an hour ago
        status, body = get(server.port, "/healthz")
        assert status == 503 and "last ticked" in body
        assert get(server.port, "/nothing")[0] == 404


def test_events_on_the_node_for_changes_and_failures_deduplicated(tmp_path):
    host = node(tmp_path)
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1"}})
        recorder = EventRecorder(api.client(), "gpu-node-1", window=600)
        agent = make_agent(host, NAMING, Steps(), KataContext(parse_config(LATE)), events=recorder,
                      retry_initial=0.01, retry_max=0.01)
        for _ in range(3):  # the same failure three times: one Event
            assert agent.reconcile("start").partly
        events = [api.get("events", n, "default") for n in api.names("events")]
        # The GPUs were bound (Reconciled); the class that failed has an Event of its own, by name.
        assert sorted((e["type"], e["reason"]) for e in events) == [("Normal", "Reconciled"),
                                                                   ("Warning", "RuntimeClassFailed")]
        failed = next(e for e in events if e["reason"] == "RuntimeClassFailed")
        # One Event, seen three times: its count raised, as client-go's EventCorrelator does.
        assert failed["count"] == 3 and failed["lastTimestamp"] >= failed["firstTimestamp"]
        assert failed["involvedObject"]["kind"] == "Node" and failed["involvedObject"]["name"] == "gpu-node-1"
        assert failed["message"].startswith("runtime class kata-qemu-nvidia-gpu: ") and "late" in failed["message"]
        assert "RuntimeClass kata-qemu-nvidia-gpu is not offered on this node" in failed["message"]
        bound = next(e for e in events if e["reason"] == "Reconciled")
        assert "bound 0000:01:00.0" in bound["message"]
        publish_layout(host)
        assert agent.reconcile("retry").ok
        events = [api.get("events", n, "default") for n in api.names("events")]
        installed = [e for e in events if e["reason"] == "Reconciled" and "installed" in e["message"]]
        assert len(installed) == 1 and "kata-qemu-nvidia-gpu" in installed[0]["message"]
        count = len(api.names("events"))
        assert agent.reconcile("again").changes == []  # nothing changed: no Event
        assert len(api.names("events")) == count


def test_the_node_is_told_what_becomes_of_its_nvswitches(tmp_path):
    """Kata before 4.1 fails every sandbox given an NVSwitch: with the defaults they stay on the
    host (a Normal Event says so); passed through at the operator's word to such a Kata, a
    Warning Event says the pods will not start."""
    from gpunode.policy.katarelease import parse_release
    from gpunode.policy.selection import NvswitchRule, Selection
    from nodesim.materialise import materialise
    from nodesim.profiles import find_profile

    for mode, reason, kind in (("auto", "NVSwitchesNotPassedThrough", "Normal"),
                               (True, "NVSwitchesFailKata", "Warning")):
        host = materialise(find_profile("dgx-h100"), tmp_path / str(mode))
        naming = Naming(PciIds.find(), selection=Selection(nvswitches=mode), nvswitch_rule=NvswitchRule(parse_release("3.25.0")))
        with FakeApiServer() as api:
            api.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "dgx-1"}})
            agent = make_agent(host, naming, Steps(kata=False), None,
                          events=EventRecorder(api.client(), "dgx-1", window=600))
            assert agent.reconcile("start").ok
            events = {e["reason"]: e for e in (api.get("events", n, "default") for n in api.names("events"))}
            assert events[reason]["type"] == kind
            assert "Kata 3.25.0 takes an NVSwitch (class 0x0680) for a bridge" in events[reason]["message"]
            other = {"NVSwitchesNotPassedThrough", "NVSwitchesFailKata"} - {reason}
            assert not other & set(events)


def test_the_recorder_is_rate_limited():
    now = [0.0]
    with FakeApiServer() as api:
        recorder = EventRecorder(api.client(), "n1", window=60, burst=3, clock=lambda: now[0])
        assert [recorder.record("R", f"m{i}") for i in range(5)] == [True, True, True, False, False]
        assert recorder.record("R", "m0") is False  # a repeat, and over the limit anyway
        # What an operator's action causes is written whatever the burst of others.
        assert recorder.record("WorkloadSwitched", "workload switch a -> b", limited=False) is True
        now[0] = 61  # the window passed: the same message is news again
        assert recorder.record("R", "m0") is True
        assert len(api.names("events")) == 5


def test_a_switch_is_recorded_after_a_burst_of_other_events():
    """Switch after switch (the node fault suite makes many within ten minutes), Reconciled
    and CdiSpecsUpdated Events fill the recorder's burst; the next WorkloadSwitched and
    GpusGivenBack are still written."""
    with FakeApiServer() as api:
        events = NodeEvents(EventRecorder(api.client(), "n1", burst=3))
        for i in range(5):
            events._record("CdiSpecsUpdated", f"wrote spec {i}")
        events.switched(True, "workload switch vm-passthrough -> container: gave 1 GPU back")
        events.given_back("gave 0000:65:00.0 back to their drivers")
        reasons = sorted(api.get("events", n, "default")["reason"] for n in api.names("events"))
        assert reasons == ["CdiSpecsUpdated"] * 3 + ["GpusGivenBack", "WorkloadSwitched"]


def test_cli_run_serves_the_endpoints_and_refuses_a_bad_address(tmp_path):
    import signal
    import socket
    import subprocess
    import sys
    from pathlib import Path

    katamgr = str(Path(sys.executable).parent / "katamgr")
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4)])
    bad = subprocess.run([katamgr, "run", "--host-root", str(host.root), "--metrics-address", "nowhere"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "HOST:PORT" in bad.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([katamgr, "run", "--host-root", str(host.root), "--no-kata",
                             "--metrics-address", f"127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: _answers(port), timeout=30), proc.stderr
        assert wait_for(lambda: get(port, "/readyz")[0] == 200, timeout=30)
        assert "katamgr_reconcile_duration_seconds" in scrape(port)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0


def _answers(port: int) -> bool:
    try:
        return get(port, "/healthz")[0] == 200
    except OSError:
        return False


def test_the_node_is_told_when_neither_nvlink_model_holds(tmp_path):
    """An NVSwitch board whose Fabric Manager does not answer and whose Kata cannot take
    NVSwitches cannot start CUDA in a Kata pod: a Warning Event and the model metric say so;
    with FM answering (dgx-h100's, Shared NVSwitch) neither complains."""
    from gpunode.policy.katarelease import parse_release
    from gpunode.policy.selection import NvswitchRule
    from gpunode.services.nvlinkfabric import SHARED, FabricSettings
    from nodesim.materialise import materialise
    from nodesim.node import open_node
    from nodesim.profiles import find_profile

    host = materialise(find_profile("dgx-h100"), tmp_path / "node")
    library, socket, modules = open_node(host.root).fabric_manager()
    naming = Naming(PciIds.find(), nvswitch_rule=NvswitchRule(parse_release("3.25.0")))
    for address, model, warned in ((socket, SHARED, False), ("/run/no-fm.sock", "none", True)):
        with FakeApiServer() as api:
            api.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "dgx-1"}})
            agent = make_agent(host, naming, Steps(kata=False), None,
                          events=EventRecorder(api.client(), "dgx-1", window=600),
                          fabric=FabricSettings(address=address, library=library, gpu_module_ids=modules))
            assert agent.reconcile("start").ok
            events = {e["reason"]: e for e in (api.get("events", n, "default") for n in api.names("events"))}
            assert ("NVLinkFabricUnavailable" in events) is warned
            if warned:
                assert events["NVLinkFabricUnavailable"]["type"] == "Warning"
                assert "FABRIC_MODE=1" in events["NVLinkFabricUnavailable"]["message"]
            assert agent.metrics.registry.get_sample_value("katamgr_nvlink_fabric_model", {"model": model}) == 1
