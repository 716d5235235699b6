"""Revert undoes what apply recorded on the node, whatever config it is given,
and ``katamgr status`` shows that record, including a run killed part-way.

On simulated nodes with the shipped OCI layout and the demo's containerd config
(``support.kataconfig``); the kill is a real SIGKILL at a write point
(``gpunode.host.faults``), as a power cut or an OOM kill would stop apply.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.kataconfig import DEMO_CONTAINERD, kata_manager_yaml, prepare_node

from gpunode.host import faults
from gpunode.kataclasses import GPU
from katamgr.cli import main
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

KATAMGR = str(Path(sys.executable).parent / "katamgr")


@pytest.fixture
def node(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBECONFIG", raising=False)  # no cluster: the node's half only
    host = prepare_node(materialise(find_profile("workstation-a6000"), tmp_path / "host"))
    for name, directory in (("a.yaml", "/opt/artifacts-a"), ("b.yaml", "/opt/artifacts-b")):
        (tmp_path / name).write_text(kata_manager_yaml((GPU,), artifacts_dir=directory))
    return host


def katamgr(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_revert_with_another_config_removes_what_apply_installed(node, capsys):
    root, configs = str(node.root), node.root.parent
    assert katamgr(capsys, "apply", "--host-root", root, "--config", str(configs / "a.yaml"))[0] == 0
    installed = node.path(f"/opt/artifacts-a/{GPU}")
    assert any(installed.iterdir())
    code, out, _ = katamgr(capsys, "status", "--host-root", root, "-o", "json")
    status = json.loads(out)
    assert [(c["name"], c["dir"]) for c in status["runtimeClasses"]] == [(GPU, f"/opt/artifacts-a/{GPU}")]
    assert status["containerd"][0]["configPath"] == "/etc/containerd/config.toml"
    assert GPU in status["containerd"][0]["runtimes"]

    code, out, err = katamgr(capsys, "revert", "--host-root", root, "--config", str(configs / "b.yaml"))
    assert code == 0, err
    assert f"removed /opt/artifacts-a/{GPU}" in out
    assert not installed.exists()
    assert node.path("/etc/containerd/config.toml").read_bytes() == DEMO_CONTAINERD.read_bytes()
    code, out, _ = katamgr(capsys, "revert", "--host-root", root, "--config", str(configs / "b.yaml"))
    assert (code, out.strip()) == (0, "nothing to revert: katamgr has no changes recorded on this node")
    assert not node.path("/var/lib/kata-sandbox-manager").exists()  # no trace left


def test_revert_without_a_config_undoes_the_whole_record(node, capsys):
    root = str(node.root)
    assert katamgr(capsys, "apply", "--host-root", root, "--config", str(node.root.parent / "a.yaml"))[0] == 0
    code, out, err = katamgr(capsys, "revert", "--host-root", root)
    assert code == 0, err
    assert "restored /etc/containerd/config.toml" in out and f"removed /opt/artifacts-a/{GPU}" in out
    assert "restored 0000:01:00.0 to nvidia" in out
    assert node.path("/etc/containerd/config.toml").read_bytes() == DEMO_CONTAINERD.read_bytes()
    assert not node.path(f"/opt/artifacts-a/{GPU}").exists()
    assert "Nothing installed" in katamgr(capsys, "status", "--host-root", root)[1]


def test_status_text_says_what_is_installed_where_since_when_and_by_which_version(node, capsys, monkeypatch):
    from importlib.metadata import version

    root = str(node.root)
    katamgr(capsys, "apply", "--host-root", root, "--config", str(node.root.parent / "a.yaml"))
    monkeypatch.setenv("COLUMNS", "80")
    _, narrow, _ = katamgr(capsys, "status", "--host-root", root)
    assert max(len(line) for line in narrow.splitlines()) <= 80
    monkeypatch.setenv("COLUMNS", "300")  # every line whole, for the checks below
    _, text, _ = katamgr(capsys, "status", "--host-root", root)
    assert f"katamgr {version('kata-sandbox-manager')} installed this node's changes (since 20" in text
    assert "0000:01:00.0  IOMMU group 15  was on nvidia" in text
    assert f"{GPU}: /opt/artifacts-a/{GPU} from oci-layout://" in text
    assert "/var/run/cdi/nvidia.com-pgpu.yaml" in text
    assert "Last run: katamgr apply" in text and "succeeded at" in text


def _cli(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in (faults.CRASH_AT, faults.WRITE_LOG, "KUBECONFIG")}
    return subprocess.run([KATAMGR, *args, "--host-root", str(root)], capture_output=True, text=True,
                          timeout=120, env=environ | {"COLUMNS": "300"} | (env or {}))


def test_a_killed_apply_printed_what_it_had_done_and_status_names_the_step(tmp_path):
    # Where the third GPU's group starts, counted on a twin of the node.
    twin = materialise(find_profile("dgx-h100"), tmp_path / "twin")
    points = tmp_path / "points"
    assert _cli(twin.root, "apply", env={faults.WRITE_LOG: str(points)}).returncode == 0
    labels = points.read_text().splitlines()
    third = next(int(line.split()[0]) for line in labels if "0000:13:00.0" in line)

    host = materialise(find_profile("dgx-h100"), tmp_path / "node")
    killed = _cli(host.root, "apply", env={faults.CRASH_AT: str(third + 1)})
    assert killed.returncode == -9
    done = [line for line in killed.stderr.splitlines() if line.endswith(": done")]
    assert done == ["katamgr apply: bind IOMMU group 6 (0000:03:00.0) to VFIO: done",
                    "katamgr apply: bind IOMMU group 8 (0000:04:00.0) to VFIO: done"]
    assert killed.stderr.splitlines()[-1] == "katamgr apply: bind IOMMU group 16 (0000:13:00.0) to VFIO..."

    status = _cli(host.root, "status")
    assert "INTERRUPTED at: bind IOMMU group 16 (0000:13:00.0) to VFIO (after 2 steps done)" in status.stdout
    doc = json.loads(_cli(host.root, "status", "-o", "json").stdout)
    assert (doc["lastRun"]["outcome"], doc["lastRun"]["step"]) == ("interrupted",
                                                                    "bind IOMMU group 16 (0000:13:00.0) to VFIO")
    # The two groups bound, and the one whose move was under way (recorded before its first write).
    assert [d["bdf"] for d in doc["devices"]] == ["0000:03:00.0", "0000:04:00.0", "0000:13:00.0"]

    again = _cli(host.root, "apply")
    assert again.returncode == 0
    assert json.loads(_cli(host.root, "status", "-o", "json").stdout)["lastRun"]["outcome"] == "succeeded"


def test_status_shows_a_record_it_cannot_read_as_a_problem(node, capsys):
    root = str(node.root)
    katamgr(capsys, "apply", "--host-root", root)
    node.state_path("vfio.json").write_text("{not json")
    code, out, _ = katamgr(capsys, "status", "--host-root", root, "-o", "json")
    doc = json.loads(out)
    # Named with its fix, and an exit code a script sees (revert would lose what it recorded).
    assert code == 6 and doc["devices"] == []
    assert any("vfio.json is not valid JSON" in p["message"] for p in doc["problems"])
    assert doc["cdiSpecs"]  # the other records are still shown
