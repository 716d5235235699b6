"""Revert (the chart's uninstall hook) removes everything the node's records list, whatever the
values say now: a manager turned off since (``--no-kata``, ``--no-vfio``, ``--no-cdi``, which
the hook passes from today's values) stops new work, never the undoing; an ``artifactsDir``
moved between two applies keeps the earlier dir in the record, in ``status``, until revert.

Before: ``helm uninstall`` after ``kataManager`` or ``vfioManager`` was turned off left the
artifacts, the containerd entries or the bound GPUs behind, silently; after an
``artifactsDir`` move the old dir dropped out of the record.
"""

from __future__ import annotations

import json

import pytest
from support.kataconfig import DEMO_CONTAINERD, kata_manager_yaml, prepare_node

from gpunode.kataclasses import GPU
from katamgr.cli import main
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

GPU_BDF = "0000:01:00.0"


@pytest.fixture
def node(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    host = prepare_node(materialise(find_profile("workstation-a6000"), tmp_path / "host"))
    for name, directory in (("a.yaml", "/opt/artifacts-a"), ("b.yaml", "/opt/artifacts-b")):
        (tmp_path / name).write_text(kata_manager_yaml((GPU,), artifacts_dir=directory))
    return host


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def driver(host, bdf: str) -> str:
    return host.path(f"/sys/bus/pci/devices/{bdf}/driver").resolve().name


def assert_reverted(host) -> None:
    assert driver(host, GPU_BDF) == "nvidia"
    assert host.path("/etc/containerd/config.toml").read_bytes() == DEMO_CONTAINERD.read_bytes()
    assert not list(host.path("/var/run/cdi").glob("*.yaml"))
    for directory in ("/opt/artifacts-a", "/opt/artifacts-b"):
        assert not host.path(f"{directory}/{GPU}").exists()
    assert not host.path("/var/lib/kata-sandbox-manager").exists()  # no record, no trace


def test_revert_with_every_manager_turned_off_still_undoes_what_the_record_lists(node, capsys):
    root = ["--host-root", str(node.root)]
    assert run(capsys, "apply", *root, "--config", str(node.root.parent / "a.yaml"))[0] == 0
    assert driver(node, GPU_BDF) == "vfio-pci"
    # The uninstall hook's args after kataManager, vfioManager and cdi were turned off.
    code, out, err = run(capsys, "revert", *root, "--config", str(node.root.parent / "a.yaml"),
                         "--no-kata", "--no-vfio", "--no-cdi", "--no-runtime-classes")
    assert code == 0, err
    assert f"removed /opt/artifacts-a/{GPU}" in out and f"restored {GPU_BDF} to nvidia" in out
    assert_reverted(node)


def test_an_artifacts_dir_moved_keeps_the_earlier_one_recorded_until_revert_removes_it(node, capsys):
    root = ["--host-root", str(node.root)]
    assert run(capsys, "apply", *root, "--config", str(node.root.parent / "a.yaml"))[0] == 0
    assert run(capsys, "apply", *root, "--config", str(node.root.parent / "b.yaml"))[0] == 0
    assert node.path(f"/opt/artifacts-a/{GPU}").is_dir()  # a VM started before may still use it
    code, out, _ = run(capsys, "status", *root, "-o", "json")
    dirs = sorted(c["dir"] for c in json.loads(out)["runtimeClasses"])
    assert (code, dirs) == (0, [f"/opt/artifacts-a/{GPU}", f"/opt/artifacts-b/{GPU}"])
    text = run(capsys, "status", *root)[1]
    assert f"/opt/artifacts-a/{GPU}" in text and "Nothing installed" not in text

    code, out, err = run(capsys, "revert", *root, "--no-kata")
    assert code == 0, err
    assert f"removed /opt/artifacts-a/{GPU}" in out and f"removed /opt/artifacts-b/{GPU}" in out
    assert_reverted(node)
