"""--include-device / --exclude-device and the config's devices key, as an operator runs katamgr."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.hostkit import snapshot
from support.paths import REPO

from gpunode.host.root import HostRoot

KATAMGR = str(Path(sys.executable).parent / "katamgr")
STANDINS = ("--include-device", "1234:11e8=example.com/edu", "--include-device", "1234:1111=example.com/vga",
            "--exclude-device", "0000:00:01.0")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([KATAMGR, *args], capture_output=True, text=True, cwd=REPO, timeout=120)


@pytest.fixture
def node(tmp_path) -> Path:
    root = tmp_path / "node"
    assert run("simulate", "qemu-standins", "--into", str(root)).returncode == 0
    return root


def test_plan_says_why_each_device_is_in_or_out(node):
    result = run("plan", "--host-root", str(node), "--output", "json", *STANDINS)
    # 4: the plan lists a problem, the NIC's group that is not viable (0000:04:01.0 stays out).
    assert result.returncode == 4, result.stderr
    assert json.loads(result.stdout)["problems"][0]["message"].startswith("0000:04:01.0: IOMMU group 7 is not viable")
    devices = {d["bdf"]: d for d in json.loads(result.stdout)["devices"]}
    assert devices["0000:01:00.0"]["selectionMessage"] == "included by --include-device 1234:11e8 as example.com/edu"
    assert devices["0000:00:01.0"]["selectionMessage"] == "excluded by --exclude-device 0000:00:01.0"
    assert devices["0000:04:02.0"]["selectionMessage"] == "not an NVIDIA GPU, NVSwitch or included device"
    text = run("plan", "--host-root", str(node), "-o", "wide", *STANDINS).stdout
    assert "SELECTION" in text.splitlines()[3]
    assert "included by --include-device 1234:1111 as example.com/vga" in text


def test_apply_binds_the_stand_ins_and_revert_needs_no_flags(node):
    applied = run("apply", "--host-root", str(node), *STANDINS)
    assert applied.returncode == 4, applied.stderr  # done, with a device left out (its group is not viable)
    assert "changed: bound 0000:01:00.0 (1234:11e8) to vfio-pci" in applied.stdout
    assert "changed: wrote /var/run/cdi/example.com-edu.yaml" in applied.stdout
    again = run("apply", "--host-root", str(node), *STANDINS)
    # Nothing changed, but a device is still left out (a warning, on stderr): not "already as planned".
    assert again.returncode == 4 and "0000:04:01.0: IOMMU group 7 is not viable" in again.stderr
    assert "nothing to change" not in again.stdout
    reverted = run("revert", "--host-root", str(node))
    assert reverted.returncode == 0, reverted.stderr
    assert "restored 0000:02:00.0 to bochs-drm" in reverted.stdout
    assert "removed /var/run/cdi/example.com-edu.yaml" in reverted.stdout
    refused = run("revert", "--host-root", str(node), "--exclude-device", "0000:00:01.0")
    assert refused.returncode == 2 and "--exclude-device" in refused.stderr


def test_the_config_devices_key_and_the_flags_add_up(node, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("runtimeClasses: []\ndevices:\n  include: [{ids: '1234:11e8', resource: example.com/edu}]\n")
    result = run("plan", "--host-root", str(node), "--config", str(config), "--no-kata", "--output", "json",
                 "--exclude-device", "0000:00:01.0")
    assert result.returncode == 4, result.stderr  # the NIC's group is not viable (a problem listed)
    devices = {d["bdf"]: d for d in json.loads(result.stdout)["devices"]}
    assert devices["0000:01:00.0"]["selectionMessage"] == (
        "included by config devices.include 1234:11e8 as example.com/edu")
    assert devices["0000:00:01.0"]["kind"] == "excluded"
    assert "0000:02:00.0" not in devices  # the VGA stand-in is not included here


@pytest.mark.parametrize("args, message", [
    (("--include-device", "1234:11e8=edu"),
     "katamgr: --include-device: 'edu' is not an extended resource name (domain/name"),
    (("--include-device", "1234:11e8:example.com/edu"),
     "--include-device: '1234:11e8:example.com/edu' is not VENDOR:DEVICE=RESOURCE"),
    (("--exclude-device", "00:01.0"),
     "--exclude-device: '00:01.0' is not a full PCI address such as 0000:01:00.0 "
     "(with its domain: 0000:00:01.0)"),
    (("--exclude-device", "10de"), "--exclude-device: '10de' is neither a full PCI address"),
])
def test_a_bad_value_exits_2_naming_it_with_nothing_changed(node, args, message):
    before = snapshot(HostRoot.at(node))
    for command in ("plan", "apply"):
        result = run(command, "--host-root", str(node), *args)
        assert result.returncode == 2, result.stdout
        assert message in result.stderr and "Traceback" not in result.stderr
    assert snapshot(HostRoot.at(node)) == before


def test_a_bad_or_conflicting_config_exits_2_with_nothing_changed(node, tmp_path):
    before = snapshot(HostRoot.at(node))
    bad = tmp_path / "bad.yaml"
    bad.write_text("devices:\n  exclude: ['0000:00:01']\n")
    result = run("apply", "--host-root", str(node), "--config", str(bad), "--no-kata")
    assert result.returncode == 2
    assert 'devices.exclude[0] "0000:00:01" is not a full PCI address' in result.stderr
    config = tmp_path / "config.yaml"
    config.write_text("devices:\n  include: [{ids: '1234:11e8', resource: example.com/edu}]\n")
    result = run("apply", "--host-root", str(node), "--config", str(config), "--no-kata",
                 "--include-device", "1234:11e8=example.com/other")
    assert result.returncode == 2
    assert ("--include-device 1234:11e8=example.com/other and config devices.include "
            "1234:11e8=example.com/edu include 1234:11e8 under two resource names") in result.stderr
    assert snapshot(HostRoot.at(node)) == before


def test_help_explains_the_selection():
    text = run("apply", "--help").stdout
    assert "--include-device VENDOR:DEVICE=RESOURCE" in text and "--exclude-device BDF|VENDOR:DEVICE" in text
    assert "example.com/edu" in text and "display" in text
