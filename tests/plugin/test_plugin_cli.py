"""``sandbox-device-plugin``: usage, mode choice, and a real run against the kubelet simulator."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from support.apiserver import FakeApiServer
from support.paths import REPO

from gpunode.errors import ConfigError, GpuNodeError
from gpunode.host import standdown
from gpunode.host.pciids import PciIds
from gpunode.policy.naming import Naming
from gpunode.policy.workload import WORKLOAD_LABEL, NoCluster
from katamgr.pipeline.devices import apply_host
from katamgr.pipeline.plan import build_plan
from nodesim.materialise import materialise
from nodesim.profiles import find_profile
from sandbox_plugin.cli import decide_mode, main
from sandbox_plugin.commands import mode_from_host
from sandbox_plugin.manager import Mode

A10 = "nvidia.com/GA102GL_A10"
NAMING = Naming(PciIds.find())


def run_cli(*args: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sandbox_plugin.cli", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env, check=False,
    )


def start_cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "sandbox_plugin.cli", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
    )


def stop_cli(process: subprocess.Popen) -> tuple[int, str]:
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=15)
    return process.returncode, output


@pytest.fixture
def bound_a10(sim_host):
    host, kubelet = sim_host("a10-server")
    assert apply_host(host, build_plan(host, NAMING)).ok
    return host, kubelet


def test_help_explains_modes_and_options(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for word in ("vm-passthrough", "container", "auto", "--host-root", "--alias", "--nvswitch-alias",
                 "--pci-ids", "--node-name", WORKLOAD_LABEL, "SIGTERM"):
        assert word in text


def test_bad_workload_exits_2_naming_it():
    result = run_cli("--workload", "gpu-please")
    assert result.returncode == 2
    assert "'gpu-please'" in result.stderr and "--workload" in result.stderr


def test_mode_still_works_as_the_deprecated_spelling_of_workload(capsys):
    """Manifests written for the plugin before --workload say --mode: they keep working,
    and stderr says what to write instead."""
    from sandbox_plugin.cli import parse_args

    assert parse_args(["--mode", "container"]).workload == "container"
    assert "--mode is deprecated; use --workload" in capsys.readouterr().err
    assert parse_args([]).workload == "auto"
    assert "deprecated" not in capsys.readouterr().err
    result = run_cli("--mode", "gpu-please")  # checked as --workload is
    assert result.returncode == 2 and "'gpu-please'" in result.stderr


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--host-root", "/no/such/root"], "/no/such/root"),
        (["--alias", "p gpu"], "p gpu"),
        (["--nvswitch-alias=-x-"], "-x-"),
        # A container GPU's name: a runc pod asking for nvidia.com/gpu would get /dev/vfio.
        (["--alias", "gpu"], "'gpu'"),
        (["--nvswitch-alias", "mig-nvlink"], "'mig-nvlink'"),
        (["--pci-ids", "/no/such/pci.ids"], "/no/such/pci.ids"),
        (["--gpu-module-ids", "17=0000:1b:00.0"], "17=0000:1b:00.0"),
    ],
)
def test_bad_values_exit_2_naming_them(capsys, args, named):
    assert main(args) == 2
    assert named in capsys.readouterr().err


def test_auto_mode_follows_the_label_then_the_host(short_root):
    host = materialise(find_profile("a10-server"), short_root.root)

    def label(value):
        return lambda node: {} if value is None else {WORKLOAD_LABEL: value}

    def unreachable(node):
        raise ConnectionRefusedError("connection refused")

    def no_cluster(node):
        raise NoCluster("no kubeconfig")

    assert decide_mode(host, "n1", label("vm-passthrough"))[0] is Mode.VM_PASSTHROUGH
    assert decide_mode(host, "n1", label("container"))[0] is Mode.CONTAINER
    mode, why = decide_mode(host, "n1", label("vm-vgpu"))
    assert mode is None and "vm-vgpu" in why
    # No label, or no cluster to ask: the host decides (A10s still on nvidia -> container).
    for reader in (label(None), no_cluster):
        mode, why = decide_mode(host, "n1", reader)
        assert mode is Mode.CONTAINER and "no NVIDIA GPU is bound to vfio-pci" in why
    # ... unless --default-workload says what an unlabeled node runs, as for katamgr.
    assert decide_mode(host, "n1", label(None), default="vm-passthrough")[0] is Mode.VM_PASSTHROUGH
    # A bad label is bad configuration (exit 2) and an API that does not answer a
    # failure (exit 1), as for katamgr: neither is guessed around.
    with pytest.raises(ConfigError, match="'bogus'"):
        decide_mode(host, "n1", label("bogus"))
    with pytest.raises(GpuNodeError, match="connection refused") as failed:
        decide_mode(host, "n1", unreachable)
    assert failed.value.exit_code == 1

    assert apply_host(host, build_plan(host, NAMING)).ok
    mode, why = mode_from_host(host)
    assert mode is Mode.VM_PASSTHROUGH and "0000:17:00.0" in why
    assert decide_mode(host, None)[0] is Mode.VM_PASSTHROUGH


def test_runs_against_a10_server_and_stops_cleanly_on_sigterm(bound_a10):
    host, kubelet = bound_a10
    process = start_cli("--host-root", str(host.root))
    try:
        state = kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4, timeout=20)
    except TimeoutError:
        process.kill()
        raise AssertionError(process.communicate()[0]) from None
    assert [r.resource_name for r in state.registrations] == [A10]
    socket = kubelet.socket_dir / "nvidia.com-GA102GL_A10.sock"
    assert socket.is_socket()

    code, output = stop_cli(process)
    assert code == 0, output
    assert "mode vm-passthrough" in output and "bound to vfio-pci" in output
    assert not socket.exists()
    kubelet.wait_for(lambda s: A10 not in s.connected, timeout=5)


def test_a_stop_grace_out_of_range_exits_2_naming_it():
    result = run_cli("--stop-grace", "-1")
    assert result.returncode == 2 and "--stop-grace: '-1': a number of seconds from 0 to 300" in result.stderr


def test_told_to_stop_it_serves_on_until_the_offers_are_withdrawn(bound_a10):
    """--stop-grace (the chart's, beside katamgr run --offer-gate): after SIGTERM the kubelet
    still has the devices, so a pod bound before the offer labels came off is admitted; the
    agent's word (gpunode.host.standdown) ends the wait."""
    host, kubelet = bound_a10
    process = start_cli("--host-root", str(host.root), "--stop-grace", "30")
    try:
        kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4, timeout=20)
    except TimeoutError:
        process.kill()
        raise AssertionError(process.communicate()[0]) from None
    process.send_signal(signal.SIGTERM)
    time.sleep(1.5)
    assert process.poll() is None
    assert len(kubelet.state.healthy(A10)) == 4
    assert kubelet.admit_pod("tenant", "bound-before", {"main": {A10: 1}})
    standdown.tell_withdrawn(host)
    output, _ = process.communicate(timeout=10)
    assert process.returncode == 0, output
    assert "the runtime-class offers are withdrawn: stopping" in output, output
    kubelet.wait_for(lambda s: A10 not in s.connected, timeout=5)


def test_node_label_read_through_the_api_wins_over_the_host(bound_a10, tmp_path):
    host, kubelet = bound_a10
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node",
                  "metadata": {"name": "worker-1", "labels": {WORKLOAD_LABEL: "container"}}})
        env = {**os.environ, "KUBECONFIG": str(api.write_kubeconfig(tmp_path / "kubeconfig"))}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        process = start_cli("--host-root", str(host.root), "--node-name", "worker-1", env=env)
        try:
            # Container mode on a node without NVML: registered, nothing advertised.
            state = kubelet.wait_for(lambda s: "nvidia.com/gpu" in s.devices, timeout=20)
        except TimeoutError:
            process.kill()
            raise AssertionError(process.communicate()[0]) from None
        assert state.devices["nvidia.com/gpu"] == []
        time.sleep(0.2)  # would a passthrough resource show up too? it must not
        assert A10 not in kubelet.state.devices
        code, output = stop_cli(process)
    assert code == 0, output
    assert f"mode container: node worker-1 is labeled {WORKLOAD_LABEL}=container" in output
    assert "advertising no GPUs" in output
