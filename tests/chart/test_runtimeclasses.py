"""The RuntimeClasses Helm creates (runtimeclasses.yaml) are the ones katamgr would apply:
the chart's rendered kataManager config (its ConfigMap, what the agents read) fed to
katamgr.cluster.runtimeclasses.desired_runtime_classes gives the same objects, field by
field, so the two can never drift. The agents run --no-runtime-classes and may not write
one (test_rbac.py)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from chartvalues import CUSTOM_CLASSES, VALUE_SETS
from support.chartkit import FULL, RELEASE, Rendered, container, merged, render
from support.paths import EXAMPLES

from katamgr.cluster.client import MANAGED_BY_LABEL, MANAGED_BY_VALUE
from katamgr.cluster.runtimeclasses import desired_runtime_classes
from katamgr.config import parse_config

pytestmark = pytest.mark.integration

EXAMPLE_SETS = {f"example-{p.stem}": yaml.safe_load(p.read_text())
                for p in sorted((EXAMPLES / "values").glob("*.yaml"))}
EDGE_SETS = {
    # confidential set both ways, against the name; an empty nodeSelector (the default one);
    # YAML numbers as quantities (katamgr takes their text).
    "confidential-either-way": merged(FULL, {"kataManager": {"config": {
        "runtimeClasses": [
            {"name": "kata-cc", "confidential": True, "artifacts": {"url": "registry.local/kata:cc"}},
            {"name": "kata-plain-snp", "confidential": False, "nodeSelector": {},
             "artifacts": {"url": "registry.local/kata:snp"}},
            {"name": "kata-tdx", "nodeSelector": {"example.com/pool": "tdx"},
             "artifacts": {"url": "registry.local/kata:tdx"}},
        ],
        "runtimeClassOverhead": {"podFixed": {"cpu": 1, "memory": "160Mi"}},
    }}}),
    "no-classes": merged(FULL, {"kataManager": {"config": {"runtimeClasses": []}}}),
}
SETS = {**VALUE_SETS, **EXAMPLE_SETS, **EDGE_SETS}


def helm_classes(rendered: Rendered) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in rendered.objects if o["kind"] == "RuntimeClass"}


def katamgr_classes(rendered: Rendered) -> dict[str, dict[str, Any]]:
    """What katamgr builds from the config the chart gives the agents, where the agents run
    the Kata chain (without kataManager they run --no-kata: no class at all)."""
    configmap = rendered.find("ConfigMap", "-config")
    if configmap is None or "--no-kata" in container(rendered, "-sandbox-agent", "kata-manager")["args"]:
        return {}
    config = parse_config(configmap["data"]["config.yaml"])
    return {b["metadata"]["name"]: b for b in desired_runtime_classes(config)}


@pytest.mark.parametrize("values", SETS.values(), ids=SETS.keys())
def test_helms_runtime_classes_are_the_ones_katamgr_builds(chart, values):
    rendered = render(chart, values)
    helm, ours = helm_classes(rendered), katamgr_classes(rendered)
    assert list(helm) == list(ours)  # the same classes, in config order
    for name, body in ours.items():
        made = helm[name]
        # Every field katamgr sends, and nothing else.
        assert set(made) == set(body), name
        for field in set(body) - {"metadata"}:
            assert made[field] == body[field], (name, field)
        assert made["metadata"]["name"] == body["metadata"]["name"]
        # The labels are the one difference, and on purpose: Helm sets managed-by=Helm on
        # every object it owns (helm.sh/helm/v4 pkg/action/validate.go, setMetadataVisitor),
        # and katamgr run by hand finds its own classes by managed-by=kata-sandbox-manager,
        # so `katamgr revert --delete-runtimeclasses` never deletes the chart's.
        assert body["metadata"]["labels"] == {MANAGED_BY_LABEL: MANAGED_BY_VALUE}
        labels = made["metadata"]["labels"]
        assert labels[MANAGED_BY_LABEL] == "Helm"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/component"] == "runtime-class"
        assert "namespace" not in made["metadata"]


def test_the_edge_cases_come_out_as_katamgrs_rules_say(chart):
    classes = helm_classes(render(chart, EDGE_SETS["confidential-either-way"]))
    selectors = {name: c["scheduling"]["nodeSelector"] for name, c in classes.items()}
    # Each class also requires its own offer label (gpunode.kataclasses.offer_label).
    offered = "runtimeclass.kata-sandbox-manager.io/"
    assert selectors == {
        "kata-cc": {"nvidia.com/gpu.workload.config": "vm-passthrough", "nvidia.com/cc.ready.state": "true",
                    offered + "kata-cc": "true"},
        "kata-plain-snp": {"nvidia.com/gpu.workload.config": "vm-passthrough", offered + "kata-plain-snp": "true"},
        "kata-tdx": {"example.com/pool": "tdx", "nvidia.com/cc.ready.state": "true", offered + "kata-tdx": "true"},
    }
    assert {c["overhead"]["podFixed"]["cpu"] for c in classes.values()} == {"1"}
    assert helm_classes(render(chart, CUSTOM_CLASSES))["kata-gpu"]["overhead"] == {
        "podFixed": {"memory": "160Mi", "cpu": "250m"}}


def test_no_classes_without_kata_manager(chart):
    for values in ({}, VALUE_SETS["kata-off"], VALUE_SETS["plugin-only-annotated"],
                   merged(FULL, {"sandboxWorkloads": {"enabled": False}})):
        assert helm_classes(render(chart, values)) == {}


@pytest.mark.integration
def test_with_kata_deploy_true_the_classes_are_kata_deploys(chart):
    """kataDeploy: true: kata-deploy's chart creates RuntimeClasses of the same names, and two
    Helm releases cannot own one object, so this chart renders none."""
    values = merged(FULL, {"kataManager": {"config": {"kataDeploy": True}}})
    assert not [o for o in render(chart, values).objects if o["kind"] == "RuntimeClass"]
    for setting in ("auto", False):
        values = merged(FULL, {"kataManager": {"config": {"kataDeploy": setting}}})
        assert [o for o in render(chart, values).objects if o["kind"] == "RuntimeClass"]
