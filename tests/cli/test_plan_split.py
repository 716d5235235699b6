"""``katamgr plan --split VALUE``: the node's GPUs between VMs and containers as the split label
would have them, what the change would move, and the passthrough resources narrowed to the VM
share; a bad value exits 2 naming it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.paths import REPO

from gpunode.host.pciids import PciIds
from gpunode.policy.naming import resource_name

KATAMGR = str(Path(sys.executable).parent / "katamgr")
H100 = resource_name(PciIds.find(), 0x10DE, 0x2330)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([KATAMGR, *args], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_plan_shows_the_split_and_what_it_would_move():
    result = run("plan", "--host", "hgx-h100-passthrough", "--split", "index.6_7", "--output", "json")
    assert result.returncode in (0, 4), result.stderr
    plan = json.loads(result.stdout)
    split = plan["split"]
    assert split["vm"] == split["toVm"] == ["0000:93:00.0", "0000:94:00.0"]
    assert len(split["container"]) == 6 and split["toContainer"] == []
    # Only the VM share is advertised for Kata, and no full-board unit without every GPU.
    assert plan["resources"] == {H100: 2}
    bound = sorted(d["bdf"] for d in plan["devices"] if d["action"] == "bind")
    assert bound == ["0000:93:00.0", "0000:94:00.0"]


def test_plan_text_says_the_split():
    result = run("plan", "--host", "a10-server", "--split", "1")
    assert result.returncode == 0, result.stderr
    assert "GPU split (VMs / containers):" in result.stdout
    assert "1 for VMs (0000:e3:00.0), 3 for containers" in result.stdout
    assert "would move to VMs: 0000:e3:00.0" in result.stdout


def test_a_bad_split_value_exits_2_naming_it():
    result = run("plan", "--host", "a10-server", "--split", "5")
    assert result.returncode == 2
    assert "nvidia.com/gpu.workload.vm-passthrough.gpus='5' asks for 5 GPUs but the node has 4" in result.stderr
