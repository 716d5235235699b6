"""The katamgr command as an operator runs it: output, exit codes, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import HOST_PROFILES, REPO

from gpunode.host.pciids import PciIds
from gpunode.policy.naming import resource_name

KATAMGR = str(Path(sys.executable).parent / "katamgr")
H100 = resource_name(PciIds.find(), 0x10DE, 0x2330)


def run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([KATAMGR, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.mark.parametrize("profile_path", HOST_PROFILES, ids=lambda p: p.stem)
def test_plan_json_for_each_shipped_profile(profile_path):
    result = run("plan", "--host", f"examples/hosts/{profile_path.name}", "--output", "json")
    plan = json.loads(result.stdout)
    # 4 exactly when the plan lists problems (the IOMMU off, a device left out), so a script can tell.
    assert result.returncode == (4 if plan["problems"] else 0), result.stderr
    assert {"devices", "resources", "problems"} <= plan.keys()
    assert (plan["apiVersion"], plan["kind"]) == ("kata-sandbox-manager.io/v1alpha1", "Plan")
    for device in plan["devices"]:
        assert {"bdf", "kind", "driver", "iommuGroup", "numaNode", "resource", "action", "message"} <= device.keys()
        assert device["kind"] in ("gpu", "nvswitch", "companion", "other")
        assert device["action"] in ("bind", "keep", "skip")


def test_plan_text_is_a_table():
    result = run("plan", "--host", "a10-server")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("BDF"))
    assert header.split()[:4] == ["BDF", "KIND", "MODEL", "DRIVER"]
    assert "nvidia.com/GA102GL_A10: 4" in result.stdout


def test_apply_twice_then_revert_on_a_host_root(tmp_path):
    root = tmp_path / "node"
    assert run("simulate", "workstation-a6000", "--into", str(root)).returncode == 0
    first = run("apply", "--host-root", str(root))
    assert first.returncode == 0, first.stderr
    assert "changed: bound 0000:01:00.0" in first.stdout and "changed: bound 0000:01:00.1" in first.stdout
    second = run("apply", "--host-root", str(root))
    assert second.returncode == 0
    assert "nothing to change" in second.stdout
    plan = json.loads(run("plan", "--host-root", str(root), "--output", "json").stdout)
    assert {d["action"] for d in plan["devices"]} == {"keep"}
    reverted = run("revert", "--host-root", str(root))
    assert "restored 0000:01:00.0 to nvidia" in reverted.stdout
    assert "nothing to revert" in run("revert", "--host-root", str(root)).stdout


def test_demo_runs_and_tells_the_story():
    result = run("demo")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "no changes, as expected" in out
    assert "changed: bound 0000:03:00.0 (10de:2330) to vfio-pci" in out
    assert "changed: wrote /var/run/cdi/nvidia.com-pgpu.yaml" in out
    assert "changed: installed oci-layout:///opt/kata-artifacts/layout:kata-qemu-nvidia-gpu" in out
    assert "runtimes.kata-qemu-nvidia-gpu.options]" in out  # the containerd excerpt
    assert "containerd config byte-identical to before: yes" in out
    assert f"registered {H100}" in out and "8 healthy of 8" in out
    assert "CDI device nvidia.com/pgpu=0" in out and "device node /dev/vfio/6 (rw)" in out


@pytest.mark.parametrize("args, message", [
    (("plan", "--host-root", "/nonexistent/dir"), "--host-root '/nonexistent/dir' is not a directory"),
    (("plan", "--host", "no-such-profile"), "shipped: a10-server"),
    (("plan", "--host", "a10-server", "--alias", "bad alias!"), "alias 'bad alias!'"),
    (("plan", "--host", "a10-server", "--alias", "gpu"), "--alias: alias 'gpu' would advertise"),
    (("plan", "--host", "a10-server", "--pci-ids", "/nonexistent/pci.ids"), "/nonexistent/pci.ids"),
])
def test_bad_usage_exits_2_with_one_clear_sentence(args, message):
    result = run(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_simulate_refuses_a_non_empty_dir(tmp_path):
    (tmp_path / "something").write_text("x")
    result = run("simulate", "a10-server", "--into", str(tmp_path))
    assert result.returncode == 2 and "not empty" in result.stderr


def test_apply_failure_exits_1(tmp_path):
    profile = tmp_path / "p.yaml"
    profile.write_text(
        "name: no-vfio\niommu: true\nvfio_pci: missing\ndevices:\n"
        "  - {bdf: '0000:01:00.0', vendor: 0x10de, device: 0x2236, class: 0x030200, driver: nvidia, iommu_group: 3}\n"
    )
    result = run("apply", "--host", str(profile))
    assert result.returncode == 1
    assert "vfio-pci" in result.stderr and "Traceback" not in result.stderr


def test_help_explains():
    result = run("--help")
    assert result.returncode == 0
    for word in ("plan", "apply", "revert", "demo", "simulate", "exit codes"):
        assert word in result.stdout


def test_run_once_on_a_container_node_gives_back_what_apply_bound(tmp_path):
    """`katamgr run` (here --once) on a node that no longer runs VMs gives back the GPUs an
    earlier apply bound, keeping one a VM holds; a plain `apply` there only says so."""
    root = tmp_path / "node"
    assert run("simulate", "workstation-a6000", "--into", str(root)).returncode == 0
    assert run("apply", "--host-root", str(root)).returncode == 0  # no cluster: vm-passthrough
    driver = root / "sys/bus/pci/devices/0000:01:00.0/driver"
    assert driver.resolve().name == "vfio-pci"
    fd = root / "proc/4321/fd"
    fd.mkdir(parents=True)
    (root / "proc/4321/comm").write_text("qemu-system-x86\n")
    (fd / "9").symlink_to("/dev/vfio/15")  # a Kata VM holds the GPU's IOMMU group
    applied = run("apply", "--workload", "container", "--host-root", str(root))
    assert applied.returncode == 0 and "run katamgr revert to give them back" in applied.stderr  # a warning
    held = run("run", "--once", "--workload", "container", "--host-root", str(root))
    assert held.returncode == 0, held.stderr
    assert "workload switch vm-passthrough -> container, found at start" in held.stderr
    assert "0000:01:00.0 (PID 4321 (qemu-system-x86) holding /dev/vfio/15)" in held.stderr
    assert driver.resolve().name == "vfio-pci"
    assert (root / "run/nvidia/validations/workload-type").read_text() == "container\n"
    (fd / "9").unlink()  # the VM is gone
    freed = run("run", "--once", "--workload", "container", "--host-root", str(root))
    assert freed.returncode == 0, freed.stderr
    assert "gave 0000:01:00.0, 0000:01:00.1 back to their drivers" in freed.stderr
    assert driver.resolve().name == "nvidia"
    assert not list((root / "var/run/cdi").glob("*"))


def test_plan_shows_each_gpus_health_as_the_host_kernel_sees_it(tmp_path):
    """AER counts, link and reset methods per GPU, and what would keep one from a VM."""
    from gpunode.host.root import HostRoot
    from nodesim import pcierrors

    root = tmp_path / "node"
    assert run("simulate", "a10-server", "--into", str(root)).returncode == 0
    host = HostRoot.at(root)
    pcierrors.inject_aer(host, "0000:31:00.0", "fatal", "DLP")
    pcierrors.train_link(host, "0000:ca:00.0", "8.0 GT/s PCIe", 16)
    pcierrors.set_reset_methods(host, "0000:e3:00.0", None)
    result = run("plan", "--host-root", str(root), "-o", "wide")  # every line in full
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert ("  0000:31:00.0: AER fatal 1, non-fatal 0, correctable 0; link 16.0 GT/s PCIe x16 "
            "(max 16.0 GT/s PCIe x16); reset flr bus") in text
    assert ("  0000:ca:00.0: unfit for a VM: 0000:ca:00.0's PCIe link trained below its maximum: "
            "8.0 GT/s PCIe x16 (max 16.0 GT/s PCIe x16)") in text
    assert "  0000:e3:00.0: unfit for a VM: 0000:e3:00.0 has no reset method the kernel can use" in text
    plan = json.loads(run("plan", "--host-root", str(root), "--output", "json").stdout)
    gpu = next(d for d in plan["devices"] if d["bdf"] == "0000:17:00.0")
    assert gpu["healthMessage"].startswith("AER fatal 0") and gpu["unfitMessages"] == []
