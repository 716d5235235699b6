"""What the shipped examples' comments and katamgr's own output tell an operator agrees with
what katamgr and the isolation layers do."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml
from support.paths import EXAMPLES, REPO

KATAMGR = str(Path(sys.executable).parent / "katamgr")
VALUES = [REPO / "deploy/helm/kata-sandbox-manager/values.yaml", *sorted((EXAMPLES / "values").glob("*.yaml"))]


def plan(*args: str, code: int = 0) -> str:
    result = subprocess.run([KATAMGR, "plan", "--host", "a10-server", *args], capture_output=True, text=True,
                            timeout=120, cwd=REPO)
    assert result.returncode == code, result.stderr
    return result.stdout


def test_the_example_config_is_used_only_when_given():
    """examples/configs/kata-manager.yaml spells out the defaults; without --config katamgr
    reads no config and runs no Kata step, as its header says."""
    header = (EXAMPLES / "configs" / "kata-manager.yaml").read_text().split("\n\n")[0]
    assert "uses it when no config is given" not in header
    assert "runs no Kata step" in header
    assert "Kata artifacts:" not in plan()
    # 4: the example's nvcr.io is not reachable from the test machine, so plan's manifest
    # check lists both runtime classes among its problems.
    assert "Kata artifacts:" in plan("--config", "examples/configs/kata-manager.yaml", code=4)


def test_no_values_file_recommends_a_cdi_annotation_naming_a_gpu():
    # Both isolation layers refuse a pod whose cdi.k8s.io annotation names an NVIDIA CDI
    # device (docs/isolation.md); the values' cdi comments must say so, not suggest one.
    for path in VALUES:
        text = path.read_text()
        assert "cdi.k8s.io/gpu" not in text, path.name
        if "cdi.k8s.io" in text:
            assert "refused" in text, path.name


def test_plan_names_the_index_cdi_names_as_outside_kubernetes():
    out = " ".join(plan().split())  # the text wraps to the terminal's width
    assert "nvidia.com/pgpu=0" in out
    assert "Outside Kubernetes (nerdctl, ctr; refused in a pod's cdi.k8s.io annotation), nvidia.com/pgpu:" in out
    assert "For the cdi.k8s.io annotation" not in out


def test_the_label_script_says_the_agent_runs_on_every_gpu_node():
    # The sandbox agent's DaemonSet selects GPU nodes only, whatever their workload
    # (tests/chart/test_daemonsets.py); the script's comment must not say otherwise.
    text = (EXAMPLES / "label-node.sh").read_text()
    assert "runs on every GPU node" in text
    assert "runs on vm-passthrough nodes" not in text


def _keys(value) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


def test_the_plan_json_keys_docs_devices_names_are_plans(tmp_path):
    """docs/devices.md names the keys of `plan -o json` where it says "JSON: ..." or "... in
    JSON": each must be a key of the document plan prints (camelCase, as katamgr.output
    writes every key)."""
    from nodesim.profiles import SHIPPED

    data = yaml.safe_load((SHIPPED / "dgx-h100.yaml").read_text())
    data["kata"] = {"installed_by": "kata-deploy", "release": "3.29.0", "shims": ["go"]}
    profile = tmp_path / "dgx-kata-deploy.yaml"
    profile.write_text(yaml.safe_dump(data))
    result = subprocess.run([KATAMGR, "plan", "--host", str(profile), "--output", "json"], capture_output=True,
                            text=True, timeout=120, cwd=REPO)
    assert result.returncode in (0, 4), result.stderr
    keys = _keys(json.loads(result.stdout))
    text = " ".join((REPO / "docs/devices.md").read_text().split())
    named = set()
    for passage in re.findall(r"\(JSON: ([^)]*)\)", text) + re.findall(r"\(text, and `([^`]+)` in JSON\)", text):
        named |= set(re.findall(r"`([A-Za-z_]+)`", passage)) or {passage}
    assert {"kataFound", "configPath", "releaseFrom", "installedBy", "definedIn", "gpuLabels"} <= named
    assert not named - keys, f"docs/devices.md names keys plan -o json does not have: {sorted(named - keys)}"
