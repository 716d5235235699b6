"""A record katamgr keeps on the node that is damaged or not katamgr's stops apply, revert
and status with its name and the fix, exit 6 from the one table, nothing changed.

Before: a corrupt ``vfio.json`` made ``apply`` say "nothing to change" and exit 0, and
``status`` exit 0: a revert that follows the record would then have left the GPUs on
vfio-pci with nobody knowing.
"""

from __future__ import annotations

import json

import pytest
from support.kataconfig import kata_manager_yaml, prepare_node

from gpunode.kataclasses import GPU
from katamgr.cli import main
from katamgr.exitcodes import MEANING, Exit
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

STATE = "/var/lib/kata-sandbox-manager"


@pytest.fixture
def node(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    host = prepare_node(materialise(find_profile("workstation-a6000"), tmp_path / "host"))
    config = tmp_path / "kata.yaml"
    config.write_text(kata_manager_yaml((GPU,)))
    assert main(["apply", "--host-root", str(host.root), "--config", str(config)]) == 0
    capsys.readouterr()
    return host


def snapshot(host) -> dict[str, bytes]:
    root = host.path(STATE)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and p.name != "node.lock"}


@pytest.mark.parametrize("record, text", [
    ("vfio.json", "{not json"),
    ("vfio.json", "[1, 2]"),  # valid JSON, another shape
    ("vfio.json", '{"devices": {"0000:01:00.0": "nvidia"}}'),
    ("kata.json", '{"runtimeClasses": {"x": {"dir": 7}}}'),
    ("cdi.json", '{"kinds": "nvidia.com/pgpu"}'),
    ("run.json", '{"hello": "world"}'),
    ("containerd/etc_containerd_config.toml.json", "{}"),
])
def test_a_damaged_record_stops_apply_revert_and_status_naming_the_file_and_the_fix(node, capsys, record, text):
    node.path(f"{STATE}/{record}").write_text(text)
    before = snapshot(node)
    root = ["--host-root", str(node.root)]
    for command in (["apply", *root], ["revert", *root]):
        code = main(command)
        out, err = capsys.readouterr()
        assert code == Exit.RECORD == 6, err
        assert f"{STATE}/{record} is " in err
        assert f"mv {STATE}/{record} {STATE}/{record}.damaged" in err
        assert "nothing to change" not in out and "nothing to revert" not in out
        assert snapshot(node) == before  # nothing changed, the record included
    assert node.path("/sys/bus/pci/devices/0000:01:00.0/driver").resolve().name == "vfio-pci"

    code = main(["status", *root, "-o", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == Exit.RECORD
    assert any(f"{STATE}/{record} is " in p["message"] for p in doc["problems"])


def test_a_damaged_record_with_json_output_is_one_error_document(node, capsys):
    node.path(f"{STATE}/vfio.json").write_text("{not json")
    code = main(["apply", "--host-root", str(node.root), "-o", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert (code, doc["kind"], doc["exitCode"]) == (Exit.RECORD, "Error", 6)
    assert "vfio.json is not valid JSON" in doc["message"]
    assert "damaged" in MEANING[Exit.RECORD]
