"""The whole chain on a simulated node: artifacts from an OCI layout, Kata config,
containerd (checked by the real binary), RuntimeClasses (official client against
the API stand-in), a real process receiving containerd's SIGHUP, and the agent loop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.agentkit import make_agent
from support.apiserver import FakeApiServer
from support.hostkit import GPU_A10, dev, make_host
from support.kataconfig import kata_manager_yaml, prepare_node
from support.paths import REPO, require_binary

from gpunode.host.pciids import PciIds
from gpunode.kataclasses import GPU, GPU_SNP
from gpunode.policy.naming import Naming
from katamgr.config import parse_config
from katamgr.pipeline.kata_runtime import KataContext, runtimes
from katamgr.pipeline.reconcile import Steps, full_plan, reconcile, revert_all
from katamgr.runtime import check_entries

DATA = REPO / "katamgr" / "data"
ORIGINAL = (DATA / "demo" / "containerd-config.toml").read_text()
NAMING = Naming(PciIds.find())
CONFIG = kata_manager_yaml((GPU, GPU_SNP), restart_mode="signal",
                           overhead={"memory": "160Mi", "cpu": "250m"})
SOCKET_INODE = 4242424


@pytest.fixture
def containerd_proc(tmp_path):
    """A real process standing where containerd would, counting the SIGHUPs it gets."""
    counter = tmp_path / "sighups"
    code = (
        "import signal, sys, time, pathlib\n"
        f"p = pathlib.Path({str(counter)!r}); p.write_text('0')\n"
        "def hup(*_): p.write_text(str(int(p.read_text()) + 1))\n"
        "signal.signal(signal.SIGHUP, hup)\n"
        "print('ready', flush=True)\n"
        "while True: time.sleep(0.05)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc, counter
    proc.kill()
    proc.wait()


def node(tmp_path, containerd_proc=None):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4), dev("0000:02:00.0", GPU_A10, "nvidia", 5)])
    prepare_node(host)
    if containerd_proc is not None:
        # The node's /proc as the kernel shows it: containerd's listening socket
        # in PID 1's unix table, and the fd of the (real) process holding it.
        proc, _ = containerd_proc
        unix = host.path("/proc/1/net/unix")
        unix.parent.mkdir(parents=True)
        unix.write_text("Num       RefCount Protocol Flags    Type St Inode Path\n"
                        f"0000000000000000: 00000002 00000000 00010000 0001 01 {SOCKET_INODE} "
                        "/run/containerd/containerd.sock\n")
        fd = host.path(f"/proc/{proc.pid}/fd")
        fd.mkdir(parents=True)
        os.symlink(f"socket:[{SOCKET_INODE}]", fd / "7")
    return host


def sighups(containerd_proc) -> int:
    _, counter = containerd_proc
    time.sleep(0.2)  # the handler runs in the other process
    return int(counter.read_text())


def test_apply_twice_is_one_write_and_one_reload_and_revert_restores_bytes(tmp_path, containerd_proc):
    host = node(tmp_path, containerd_proc)
    ctx = KataContext(parse_config(CONFIG))
    config = host.path("/etc/containerd/config.toml")

    first = reconcile(host, NAMING, Steps(), ctx)
    assert first.ok, first.failures
    assert any(c.startswith("sent SIGHUP to containerd") for c in first.changes)
    assert sighups(containerd_proc) == 1
    written = config.stat()
    text = config.read_text()
    assert "kata-qemu-nvidia-gpu-snp" in text and "default_runtime_name = \"nvidia\"" in text
    assert "# The NVIDIA runtime stays the default" in text
    rendered = "/opt/nvidia-gpu-operator/artifacts/runtimeclasses/kata-qemu-nvidia-gpu/rendered/configuration-qemu-nvidia-gpu.toml"
    assert f'ConfigPath = "{rendered}"' in text
    kata_config = host.path(rendered).read_text()
    assert "pcie_root_port = 2" in kata_config
    assert 'kernel = "/opt/nvidia-gpu-operator/artifacts/runtimeclasses/kata-qemu-nvidia-gpu/vmlinux' in kata_config

    second = reconcile(host, NAMING, Steps(), ctx)
    assert second.ok and second.changes == []
    assert sighups(containerd_proc) == 1
    assert (config.stat().st_ino, config.stat().st_mtime_ns) == (written.st_ino, written.st_mtime_ns)

    undone = revert_all(host, Steps(), ctx)
    assert undone.ok
    assert config.read_text() == ORIGINAL
    assert sighups(containerd_proc) == 2
    assert not host.path("/opt/nvidia-gpu-operator/artifacts/runtimeclasses/kata-qemu-nvidia-gpu").exists()


def test_without_a_restart_mode_apply_and_revert_each_say_what_a_restart_would_do(tmp_path):
    host = node(tmp_path)
    ctx = KataContext(parse_config(CONFIG.replace("restartMode: signal", "restartMode: none")))
    applied = reconcile(host, NAMING, Steps(), ctx)
    assert "containerd config changed; restart containerd to load the Kata runtimes" in applied.warnings
    undone = revert_all(host, Steps(), ctx)
    assert undone.ok
    assert "containerd config changed; restart containerd to drop the Kata runtimes" in undone.warnings
    assert not any("to load the Kata runtimes" in w for w in undone.warnings)


@pytest.mark.integration
def test_real_containerd_reads_what_apply_wrote(tmp_path):
    binary = require_binary("containerd")
    host = node(tmp_path)
    ctx = KataContext(parse_config(CONFIG.replace("restartMode: signal", "restartMode: none")))
    assert reconcile(host, NAMING, Steps(), ctx).ok
    dump = subprocess.run([binary, "--config", str(host.path("/etc/containerd/config.toml")), "config", "dump"],
                          capture_output=True, text=True, timeout=60)
    assert dump.returncode == 0, dump.stderr
    for name in ("kata-qemu-nvidia-gpu", "kata-qemu-nvidia-gpu-snp"):
        assert f'runtimes.{name}]' in dump.stdout
    assert 'runtime_type = "io.containerd.kata.v2"' in dump.stdout
    assert 'default_runtime_name = "nvidia"' in dump.stdout


def test_plan_with_config_shows_each_step_and_changes_nothing(tmp_path):
    host = node(tmp_path)
    ctx = KataContext(parse_config(CONFIG))
    plan = full_plan(host, NAMING, Steps(), ctx).to_json()
    assert [a["action"] for a in plan["artifacts"]] == ["pull", "pull"]
    assert plan["containerd"]["pendingArtifacts"] == ["kata-qemu-nvidia-gpu", "kata-qemu-nvidia-gpu-snp"]
    assert [o["handler"] for o in plan["runtimeClasses"]["objects"]] == ["kata-qemu-nvidia-gpu", "kata-qemu-nvidia-gpu-snp"]
    assert host.path("/etc/containerd/config.toml").read_text() == ORIGINAL
    assert not host.path("/opt/nvidia-gpu-operator").exists()
    reconcile(host, NAMING, Steps(), KataContext(parse_config(CONFIG.replace("signal", "none"))))
    plan = full_plan(host, NAMING, Steps(), ctx).to_json()
    assert [a["action"] for a in plan["artifacts"]] == ["check", "check"]
    assert plan["containerd"]["changed"] is False and plan["containerd"]["diff"] == ""
    # The shipped configs cold-plug from PodResources: no annotation needed.
    assert [a["coldPlugGaps"] for a in plan["artifacts"]] == [[], []]
    # An installed config without the socket makes plan say pods need the annotation.
    shipped = host.path("/opt/nvidia-gpu-operator/artifacts/runtimeclasses/kata-qemu-nvidia-gpu/"
                        "configuration-qemu-nvidia-gpu.toml")
    shipped.write_text(shipped.read_text().replace("pod_resource_api_sock", "# pod_resource_api_sock"))
    gaps = full_plan(host, NAMING, Steps(), ctx).to_json()["artifacts"][0]["coldPlugGaps"]
    assert any("pod_resource_api_sock" in g for g in gaps) and "cdi.k8s.io/gpu" in gaps[-1]


def test_runtime_classes_follow_the_config_through_the_official_client(tmp_path):
    host = node(tmp_path)
    with FakeApiServer() as api:
        ctx = KataContext(parse_config(CONFIG.replace("signal", "none")), api.client(), "gpu-operator")
        report = reconcile(host, NAMING, Steps(), ctx)
        assert "created RuntimeClass kata-qemu-nvidia-gpu" in report.changes
        gpu = api.get("runtimeclasses", "kata-qemu-nvidia-gpu")
        assert gpu["handler"] == "kata-qemu-nvidia-gpu"
        assert gpu["scheduling"]["nodeSelector"] == {"nvidia.com/gpu.workload.config": "vm-passthrough",
                                                     "runtimeclass.kata-sandbox-manager.io/kata-qemu-nvidia-gpu": "true"}
        assert gpu["overhead"]["podFixed"] == {"memory": "160Mi", "cpu": "250m"}
        api.clear_log()
        assert reconcile(host, NAMING, Steps(), ctx).changes == []
        assert api.writes() == []
        # A node's revert leaves the cluster-wide classes to the other nodes...
        revert_all(host, Steps(), ctx)
        assert api.names("runtimeclasses") == ["kata-qemu-nvidia-gpu", "kata-qemu-nvidia-gpu-snp"]
        # ...unless the operator says this is the last one.
        revert_all(host, Steps(), ctx, delete_runtime_classes=True)
        assert api.names("runtimeclasses") == []


def test_one_nodes_failed_pull_keeps_the_cluster_wide_class(tmp_path):
    host = node(tmp_path)
    broken = CONFIG.replace("layout:kata-qemu-nvidia-gpu-snp", "layout:no-such-tag").replace("signal", "none")
    with FakeApiServer() as api:
        # Other nodes set the classes up; this one cannot pull one of its artifacts.
        reconcile(node(tmp_path / "other"), NAMING, Steps(),
                  KataContext(parse_config(CONFIG.replace("signal", "none")), api.client(), "gpu-operator"))
        report = reconcile(host, NAMING, Steps(), KataContext(parse_config(broken), api.client(), "gpu-operator"))
        assert report.partly and "no-such-tag" in report.classes_failed[GPU_SNP]
        assert sorted(api.names("runtimeclasses")) == ["kata-qemu-nvidia-gpu", "kata-qemu-nvidia-gpu-snp"]


def test_a_failed_pull_fails_its_class_alone(tmp_path):
    host = node(tmp_path)
    broken = CONFIG.replace("layout:kata-qemu-nvidia-gpu-snp", "layout:no-such-tag").replace("signal", "none")
    report = reconcile(host, NAMING, Steps(), KataContext(parse_config(broken)))
    # The class is named, with its cause; nothing else failed.
    assert report.failures == [] and list(report.classes_failed) == [GPU_SNP]
    assert "no-such-tag" in report.classes_failed[GPU_SNP]
    # The GPUs are bound, the CDI spec written, the other class installed and registered.
    assert sorted(report.moved) == ["0000:01:00.0", "0000:02:00.0"]
    assert host.path("/var/run/cdi/nvidia.com-GA102GL_A10.yaml").is_file()
    assert report.classes_ready == [GPU]
    assert [r.name for r in runtimes(host, KataContext(parse_config(broken)))] == [GPU]
    containerd = host.path("/etc/containerd/config.toml").read_text()
    assert f"runtimes.{GPU}]" in containerd and GPU_SNP not in containerd
    assert not host.path(f"/opt/nvidia-gpu-operator/artifacts/runtimeclasses/{GPU_SNP}").exists()
    # A retry of that class alone (the agent's) leaves the installed one unasked and succeeds once
    # the source is right.
    fixed = KataContext(parse_config(CONFIG.replace("signal", "none")), retry_classes=frozenset({GPU_SNP}))
    again = reconcile(host, NAMING, Steps(), fixed)
    assert again.ok and again.classes_ready == [GPU, GPU_SNP]
    assert [c.split(" (")[0] for c in again.changes if c.startswith("installed")] == [
        f"installed oci-layout:///opt/kata-artifacts/layout:{GPU_SNP}"]


def test_workload_container_binds_nothing(tmp_path):
    host = node(tmp_path)
    report = reconcile(host, NAMING, Steps(workload="container"), KataContext(parse_config(CONFIG)))
    assert report.changes == []
    assert host.path("/etc/containerd/config.toml").read_text() == ORIGINAL
    # Relabeled from vm-passthrough: the GPUs stay (a VM may hold them), and it says so.
    reconcile(host, NAMING, Steps(), None)
    report = reconcile(host, NAMING, Steps(workload="container"), None)
    assert report.changes == []
    assert any("0000:01:00.0, 0000:02:00.0 stay on vfio-pci" in w for w in report.warnings)


def test_agent_reapplies_when_someone_drops_our_entries(tmp_path, containerd_proc):
    host = node(tmp_path, containerd_proc)
    ctx = KataContext(parse_config(CONFIG))
    agent = make_agent(host, NAMING, Steps(), ctx, repull_interval=3600)
    agent.reconcile("start")
    thread = threading.Thread(target=agent.loop, daemon=True)
    thread.start()
    try:
        time.sleep(0.3)
        assert agent.reconciler.reconciles == 1
        # Another tool rewrites containerd's config without our runtimes, and
        # restarts containerd: the GPU Operator's kata manager never notices.
        host.path("/etc/containerd/config.toml").write_text(ORIGINAL)
        deadline = time.monotonic() + 10
        while agent.reconciler.reconciles < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert agent.reconciler.reconciles == 2
        assert check_entries(host, "/etc/containerd/config.toml", runtimes(host, ctx)) == []
        # An unrelated write to the same dir does not trigger a reconcile.
        host.path("/etc/containerd/other.toml").write_text("# unrelated\n")
        time.sleep(0.5)
        assert agent.reconciler.reconciles == 2
    finally:
        agent.request_stop()
        thread.join(timeout=15)
    assert not thread.is_alive()


def test_agent_keeps_the_cdi_specs_in_step_with_rebinds_and_hotplug(tmp_path):
    import cdi
    from nodesim import kernel

    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4), dev("0000:02:00.0", GPU_A10, "nvidia", 5)])
    agent = make_agent(host, NAMING, Steps(kata=False), None, check_interval=0.1)
    agent.reconcile("start")
    spec = host.path("/var/run/cdi/nvidia.com-GA102GL_A10.yaml")
    assert [d.name for d in cdi.read_spec(spec).devices] == ["0000:01:00.0", "0000:02:00.0"]
    thread = threading.Thread(target=agent.loop, daemon=True)
    thread.start()
    try:
        # Someone gives a GPU back to nvidia by hand: Kata must not be offered it.
        kernel.handle_write(host, "/sys/bus/pci/drivers/vfio-pci/unbind", "0000:02:00.0")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if [d.name for d in cdi.read_spec(spec).devices] == ["0000:01:00.0"]:
                break
            time.sleep(0.05)
        assert [d.name for d in cdi.read_spec(spec).devices] == ["0000:01:00.0"]
        assert agent.reconciler.reconciles == 1  # the specs alone were rewritten
    finally:
        agent.request_stop()
        thread.join(timeout=15)
    assert not thread.is_alive()


def test_cli_run_once_and_bad_config(tmp_path):
    katamgr = str(Path(sys.executable).parent / "katamgr")
    host = node(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("runtimeClasses:\n  - name: Kata_GPU\n    artifacts: {url: ''}\n")
    result = subprocess.run([katamgr, "apply", "--host-root", str(host.root), "--config", str(bad)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert 'runtimeClasses[0].name "Kata_GPU"' in result.stderr
    assert host.path("/etc/containerd/config.toml").read_text() == ORIGINAL
    assert not host.state_path("vfio.json").exists()
    good = tmp_path / "good.yaml"
    good.write_text(CONFIG.replace("signal", "none"))
    result = subprocess.run([katamgr, "run", "--once", "--host-root", str(host.root), "--config", str(good)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "kata-qemu-nvidia-gpu" in host.path("/etc/containerd/config.toml").read_text()


def test_cli_run_stops_on_sigterm_and_reverts_when_asked(tmp_path):
    katamgr = str(Path(sys.executable).parent / "katamgr")
    host = node(tmp_path)
    good = tmp_path / "good.yaml"
    good.write_text(CONFIG.replace("signal", "none"))
    proc = subprocess.Popen([katamgr, "run", "--host-root", str(host.root), "--config", str(good), "--revert-on-exit"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while "kata-qemu-nvidia-gpu" not in host.path("/etc/containerd/config.toml").read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "received SIGTERM" in err
    assert host.path("/etc/containerd/config.toml").read_text() == ORIGINAL


def test_revert_without_the_config_undoes_what_the_record_lists(tmp_path):
    katamgr = str(Path(sys.executable).parent / "katamgr")
    host = node(tmp_path)
    good = tmp_path / "good.yaml"
    good.write_text(CONFIG.replace("signal", "none"))
    assert subprocess.run([katamgr, "apply", "--host-root", str(host.root), "--config", str(good)],
                          capture_output=True, timeout=60).returncode == 0
    result = subprocess.run([katamgr, "revert", "--host-root", str(host.root)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert host.path("/etc/containerd/config.toml").read_text() == ORIGINAL


def test_a_node_applied_before_the_kata_record_still_asks_for_its_config(tmp_path):
    """A node an older katamgr set up has containerd edit state but no kata.json: only the
    config that applied it names its paths, and revert says so rather than half-reverting."""
    katamgr = str(Path(sys.executable).parent / "katamgr")
    host = node(tmp_path)
    good = tmp_path / "good.yaml"
    good.write_text(CONFIG.replace("signal", "none"))
    assert subprocess.run([katamgr, "apply", "--host-root", str(host.root), "--config", str(good)],
                          capture_output=True, timeout=60).returncode == 0
    host.state_path("kata.json").unlink()  # as an older release left the node
    result = subprocess.run([katamgr, "revert", "--host-root", str(host.root)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1
    assert "pass the same --config FILE" in result.stderr
    result = subprocess.run([katamgr, "revert", "--host-root", str(host.root), "--config", str(good)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert host.path("/etc/containerd/config.toml").read_text() == ORIGINAL


def test_agent_carries_an_edit_into_its_drop_in(tmp_path):
    host = node(tmp_path)
    # containerd 1.x with a conf.d: our entries go to a drop-in that repeats the
    # CRI section, so an operator's later edit of the main file must reach it.
    main = host.path("/etc/containerd/config.toml")
    main.write_text('imports = ["/etc/containerd/conf.d/*.toml"]\n' + ORIGINAL)
    host.path("/etc/containerd/conf.d").mkdir()
    ctx = KataContext(parse_config(CONFIG.replace("signal", "none")))
    agent = make_agent(host, NAMING, Steps(), ctx)
    agent.reconcile("start")
    drop_in = next(host.path("/etc/containerd/conf.d").glob("*.toml"))
    assert 'default_runtime_name = "nvidia"' in drop_in.read_text()
    assert agent.containerd_drift() is None
    main.write_text(main.read_text().replace('default_runtime_name = "nvidia"', 'default_runtime_name = "runc"'))
    assert agent.containerd_drift() is not None
    agent.reconcile("drift")
    assert 'default_runtime_name = "runc"' in drop_in.read_text()
    assert agent.containerd_drift() is None


@pytest.mark.parametrize(("release", "guest"), [
    ("3.25.0", "kernel + initrd"), ("3.29.0", "kernel + EROFS image (dm-verity)"),
    ("4.1.0", "kernel + EROFS image (dm-verity) + guest extension images"), ("", "what the artifact's Kata config")])
def test_plan_says_which_guest_each_runtime_class_gets_and_why(tmp_path, release, guest):
    host = node(tmp_path)
    config = CONFIG + (f"devices:\n  kataVersion: {release}\n" if release else "")
    plan = full_plan(host, NAMING, Steps(), KataContext(parse_config(config)))
    entries = plan.to_json()["artifacts"]
    assert [e["guest"]["format"].startswith(guest) for e in entries] == [True, True]
    lines = next(s for s in plan.sections if s.key == "artifacts").lines
    said = [line for line in lines if line.startswith("  guest: ")]
    assert len(said) == 2 and (f"Kata {release}" if release else "not known") in said[0]
