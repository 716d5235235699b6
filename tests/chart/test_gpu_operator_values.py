"""The NVIDIA GPU Operator's own values file, passed to this chart unchanged (tests/data/gpu-operator:
its values.yaml of v26.7.0, byte for byte): it renders, the keys this chart has a counterpart for
are applied, and every other key is named once in NOTES.txt as an ignored GPU Operator value."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from support.chartkit import CHART, container, merged, notes, render
from support.paths import TEST_DATA

pytestmark = pytest.mark.integration

GPU_OPERATOR_FILE = TEST_DATA / "gpu-operator" / "values-v26.7.0.yaml"
GPU_OPERATOR_VALUES = yaml.safe_load(GPU_OPERATOR_FILE.read_text())
# What a GPU Operator user switches on for Kata (NVIDIA's docs: sandboxWorkloads.enabled, mode kata).
WITH_SANDBOX = merged(GPU_OPERATOR_VALUES, {"sandboxWorkloads": {"enabled": True, "mode": "kata"}})
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
OWN_DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())


def ignored(text: str) -> list[str]:
    lines = [line for line in text.splitlines() if line.startswith("ignored GPU Operator values: ")]
    assert len(lines) == 1, text
    return lines[0].split(": ", 1)[1].split(", ")


def gpu_operator_only_keys() -> list[str]:
    """ksm.gpuOperatorOnlyKeys, as templates/_notes.tpl writes it."""
    text = (CHART / "templates" / "_notes.tpl").read_text()
    body = re.search(r'define "ksm.gpuOperatorOnlyKeys" -}}\n(.*?)\n{{- end', text, re.S)
    assert body, "ksm.gpuOperatorOnlyKeys is gone from _notes.tpl"
    return json.loads(body.group(1))


def test_every_top_level_key_of_the_gpu_operator_is_known():
    # The schema refuses unknown keys (a typo fails the install); the GPU Operator's are all
    # known: ours where this chart has a counterpart, the rest accepted whatever they hold.
    own = set(OWN_DEFAULTS) | {"kataSandboxDevicePlugin", "ccManager"}
    theirs = set(GPU_OPERATOR_VALUES)
    assert theirs <= set(SCHEMA["properties"])
    assert sorted(theirs - own) == sorted(gpu_operator_only_keys())
    for key in gpu_operator_only_keys():
        assert "ignored" in SCHEMA["properties"][key]["description"]


@pytest.mark.parametrize("values", [GPU_OPERATOR_VALUES, WITH_SANDBOX], ids=["as-shipped", "sandbox-on"])
def test_the_file_renders_unchanged_and_lists_each_ignored_key_once(chart, values):
    text = notes(chart, values)
    listed = ignored(text)
    assert len(listed) == len(set(listed)), listed
    for key in gpu_operator_only_keys():
        set_to_something = GPU_OPERATOR_VALUES[key] not in (False, "", [], {}, None)
        assert (key in listed) == set_to_something, key
    # The operands' images are NVIDIA's and never used: listed.
    for block in ("vfioManager", "sandboxDevicePlugin", "kataSandboxDevicePlugin", "devicePlugin", "ccManager"):
        assert f"{block}.image" in listed
    assert "hostPaths.driverInstallDir" in listed


def test_its_kubevirt_default_is_listed_while_sandbox_workloads_are_off(chart):
    assert GPU_OPERATOR_VALUES["sandboxWorkloads"] == {"enabled": False, "defaultWorkload": "container",
                                                      "mode": "kubevirt"}
    assert "sandboxWorkloads.mode" in ignored(notes(chart, GPU_OPERATOR_VALUES))
    assert "sandboxWorkloads.mode" not in ignored(notes(chart, WITH_SANDBOX))


def test_the_keys_with_a_counterpart_are_applied(chart):
    rendered = render(chart, WITH_SANDBOX)
    daemonsets = rendered.daemonsets()
    assert daemonsets
    for ds in daemonsets:
        pod = ds["spec"]["template"]["spec"]
        assert pod["priorityClassName"] == GPU_OPERATOR_VALUES["daemonsets"]["priorityClassName"]
        assert GPU_OPERATOR_VALUES["daemonsets"]["tolerations"][0] in pod["tolerations"]
        assert ds["spec"]["updateStrategy"]["type"] == GPU_OPERATOR_VALUES["daemonsets"]["updateStrategy"]
    # vfioManager, kataManager (its config {} keeps this chart's default classes), CDI and
    # the Kata device plugin are on, as the file says; ccManager.enabled is the agent's job.
    args = container(rendered, "-sandbox-agent", "kata-manager")["args"]
    assert "--cc-manager" in args
    assert {"kata-manager", "sandbox-device-plugin"} <= {
        c["name"] for c in rendered.get("DaemonSet", "-sandbox-agent")["spec"]["template"]["spec"]["containers"]}
    # No image of NVIDIA's operands is run: only this chart's.
    assert {c["image"] for _, c in rendered.containers()} == {c["image"] for _, c in render(chart, {
        "sandboxWorkloads": {"enabled": True}}).containers()}
