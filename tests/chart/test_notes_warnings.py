"""What NOTES.txt warns about before a node shows it: references to a placeholder registry
(the shipped examples name example.com hosts for the operator to replace), DRA's gap in Kata
(no released Kata cold-plugs a claimed GPU: docs/devices.md, tests/kata), the workloads the
chart does not serve; and vm-vgpu as the default workload, refused at render with the reason."""

from __future__ import annotations

import pytest
import yaml
from support.chartkit import FULL, SANDBOX, merged, notes, render
from support.paths import EXAMPLES

pytestmark = pytest.mark.integration

MIXED = yaml.safe_load((EXAMPLES / "values" / "mixed-cluster.yaml").read_text())
SHIPPED_VALUES = sorted((EXAMPLES / "values").glob("*.yaml"))


def test_the_mixed_cluster_example_is_warned_about_its_placeholder_mirror(chart):
    text = notes(chart, MIXED)
    assert "WARNING: these references name a placeholder host" in text
    assert ("runtime class kata-qemu-nvidia-gpu-snp's artifacts: "
            "registry.example.com/mirror/kata-gpu-artifacts:ubuntu22.04-535.86.10-snp") in text
    # The class whose artifacts are on nvcr.io is not named.
    assert "runtime class kata-qemu-nvidia-gpu's" not in text


def test_a_placeholder_image_is_warned_about(chart):
    text = notes(chart, merged(FULL, {"image": {"repository": "example.org/me"}}))
    assert "image (image.repository): example.org/me/kata-sandbox-manager" in text


@pytest.mark.parametrize("repository", ["ghcr.io/kata-sandbox-manager", "registry.local:5000/mirror",
                                        "notexample.com/x", "example.company.io/x"])
def test_a_real_looking_registry_is_not(chart, repository):
    assert "placeholder" not in notes(chart, merged(FULL, {"image": {"repository": repository}}))


@pytest.mark.parametrize("path", [p for p in SHIPPED_VALUES if p.name != "mixed-cluster.yaml"],
                         ids=lambda p: p.name)
def test_the_other_shipped_values_name_no_placeholder(chart, path):
    assert "placeholder" not in notes(chart, yaml.safe_load(path.read_text()))


def test_dra_warns_that_no_kata_release_cold_plugs_a_claimed_gpu(chart):
    text = notes(chart, merged(FULL, {"dra": {"enabled": True}}))
    assert "WARNING: dra.enabled=true: no Kata release cold-plugs a GPU given by a ResourceClaim" in text
    assert "#13322" in text and "dra.enabled=false" in text
    assert "ResourceClaim" not in notes(chart, FULL)


def test_the_notes_say_which_workloads_are_served(chart):
    text = notes(chart, SANDBOX)
    assert "serves the workloads container and vm-passthrough only" in text
    assert "a node labeled vm-vgpu" in text


@pytest.mark.parametrize("values", [
    {"sandboxWorkloads": {"defaultWorkload": "vm-vgpu"}},
    merged(FULL, {"sandboxWorkloads": {"defaultWorkload": "vm-vgpu"}}),
], ids=["sandbox-off", "sandbox-on"])
def test_vm_vgpu_as_the_default_workload_is_refused_with_the_reason(helm, chart, values):
    with pytest.raises(helm.HelmError) as caught:
        render(chart, values)
    message = str(caught.value)
    assert "sandboxWorkloads.defaultWorkload=vm-vgpu" in message, message
    assert "does not run NVIDIA vGPU" in message and "NVIDIA GPU Operator" in message, message


@pytest.mark.parametrize("workload", ["container", "vm-passthrough"])
def test_the_served_default_workloads_render(chart, workload):
    assert render(chart, merged(FULL, {"sandboxWorkloads": {"defaultWorkload": workload}})).objects

