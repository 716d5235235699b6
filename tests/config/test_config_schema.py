"""The chart's schema for the agent's config is generated from the config model, and agrees
with it: what the schema accepts the agent loads, what the agent refuses the schema refuses
(save the artifact reference grammar, which the schema leaves to the agent and to the chart's
render check, tests/chart/test_artifact_refs.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest
import yaml
from configkit import BAD_CASES
from support.chartkit import CHART, FULL, NAMESPACE, RELEASE, load_helm, merged
from support.paths import EXAMPLES, REPO

from gpunode import k8snames
from katamgr.config import InvalidConfig, config_from_dict, default_config
from katamgr.config_schema import (
    CHART_OVERLAY,
    CHART_SCHEMA,
    chart_parts,
    config_schema,
    dump,
    with_chart_parts,
)
from katamgr.runtime.settings import RestartMode

VALIDATOR = jsonschema.Draft7Validator(config_schema())
REFRESH = "python -m katamgr.config_schema --chart deploy/helm/kata-sandbox-manager/values.schema.json"


def chart_schema() -> dict:
    return json.loads(CHART_SCHEMA.read_text())


def test_the_schema_is_valid_draft_07():
    jsonschema.Draft7Validator.check_schema(config_schema())
    jsonschema.Draft7Validator.check_schema(chart_schema())


def test_the_committed_chart_schema_is_what_the_model_generates():
    assert CHART_SCHEMA == REPO / "deploy" / "helm" / "kata-sandbox-manager" / "values.schema.json"
    text = CHART_SCHEMA.read_text()
    assert dump(with_chart_parts(json.loads(text))) == text, f"stale; run: {REFRESH}"


def test_the_generator_checks_and_rewrites_a_stale_file(tmp_path):
    stale = chart_schema()
    stale["properties"]["kataManager"]["properties"]["config"]["properties"][
        "insecureRegistries"]["items"]["pattern"] = "^[A-Za-z0-9.-]+(:[0-9]+)?$"
    path = tmp_path / "values.schema.json"
    path.write_text(dump(stale))
    command = [sys.executable, "-m", "katamgr.config_schema", "--chart", str(path)]
    check = subprocess.run([*command, "--check"], capture_output=True, text=True, cwd=REPO)
    assert check.returncode == 1 and "is not what the config model generates" in check.stderr
    assert subprocess.run(command, capture_output=True, cwd=REPO).returncode == 0
    assert path.read_text() == CHART_SCHEMA.read_text()


def test_the_chart_differs_from_the_model_only_by_its_overlay():
    model = config_schema()["properties"]
    chart = chart_schema()["properties"]
    config = chart["kataManager"]["properties"]["config"]
    assert set(config["properties"]) == set(model) - {"containerd", "devices", "podResourceDeviceSources", "splits"}
    # The split per node pool is sandboxWorkloads.splits, rendered into the agent's config.
    assert CHART_OVERLAY["sandbox_keys"] == ["splits"]
    assert chart["sandboxWorkloads"]["properties"]["splits"] == model["splits"]
    # The chart sets the Kata config's device sources from dra.enabled.
    assert CHART_OVERLAY["chart_set_keys"] == ["podResourceDeviceSources"]
    # The device selection is the chart's top-level devices value (both containers get it).
    assert CHART_OVERLAY["top_level_keys"] == ["devices"]
    assert chart["devices"] == chart_parts()[("properties", "devices")]
    assert chart["devices"]["properties"]["exclude"] == model["devices"]["properties"]["exclude"]
    for key, schema in config["properties"].items():
        assert schema == chart_parts()[("properties", "kataManager", "properties", "config")][
            "properties"][key]
    assert config["required"] == CHART_OVERLAY["config_required"] == ["artifactsDir",
                                                                     "runtimeClasses"]
    assert config_schema().get("required") is None  # the agent defaults both
    containerd = chart["containerd"]
    assert list(containerd["properties"]) == CHART_OVERLAY["containerd_keys"]
    assert set(containerd["properties"]) < set(model["containerd"]["properties"])
    assert containerd["properties"]["restartMode"]["enum"] == ["signal", "none"]
    assert model["containerd"]["properties"]["restartMode"]["enum"] == [m.value for m in RestartMode]
    assert config["properties"]["insecureRegistries"]["items"]["pattern"] == (
        model["insecureRegistries"]["items"]["pattern"])


def test_the_chart_name_definitions_are_k8snames():
    definitions = chart_schema()["definitions"]
    assert definitions["dnsLabel"]["pattern"] == k8snames.DNS1123_LABEL_PATTERN
    assert definitions["dnsLabel"]["maxLength"] == k8snames.DNS1123_LABEL_MAX
    assert definitions["dnsSubdomain"]["pattern"] == k8snames.DNS1123_SUBDOMAIN_PATTERN
    assert definitions["dnsSubdomain"]["maxLength"] == k8snames.DNS1123_SUBDOMAIN_MAX


@pytest.mark.parametrize("data", [
    default_config().to_dict(),
    {},
    yaml.safe_load((EXAMPLES / "configs" / "kata-manager.yaml").read_text()),
    yaml.safe_load((EXAMPLES / "configs" / "air-gapped.yaml").read_text()),
    {"runtimeClasses": [{"name": "kata-nvidia-gpu", "nodeSelector": {"example.com/pool": ""},
                         "artifacts": {"url": "oci-layout:///srv/kata:v1", "pullSecret": "ngc"}}],
     "containerd": {"version": 3, "restartMode": "systemd", "podAnnotations": ["io.kata*"]},
     "runtimeClassOverhead": {"podFixed": {"memory": "160Mi", "cpu": 1, "nvidia.com/gpu": "0"}},
     "insecureRegistries": ["registry.lab:5000", "10.0.0.1", "localhost"]},
], ids=["default", "empty", "example", "example-air-gapped", "every-key"])
def test_what_the_schema_accepts_the_agent_loads(data):
    VALIDATOR.validate(data)
    config_from_dict(data)


# The artifact reference grammar (registry host, repository, tag, digest, layout path) is
# the agent's alone: the schema only asks for a non-empty string.
AGENT_ONLY = ("is not an artifact reference",)


@pytest.mark.parametrize("data, fragment", BAD_CASES,
                         ids=[f"case{i}" for i in range(len(BAD_CASES))])
def test_what_the_agent_refuses_the_schema_refuses(data, fragment):
    with pytest.raises(InvalidConfig) as refused:
        config_from_dict(data)
    problems = refused.value.problems
    if all(any(reason in p for reason in AGENT_ONLY) for p in problems):
        assert VALIDATOR.is_valid(data), "the schema now checks artifact URLs: drop AGENT_ONLY"
    else:
        assert not VALIDATOR.is_valid(data), problems


@pytest.mark.parametrize("values, fragment", [
    ({"insecureRegistries": ["-registry.lab"]}, "/kataManager/config/insecureRegistries/0"),
    ({"insecureRegistries": ["registry.lab:123456"]}, "/kataManager/config/insecureRegistries/0"),
    ({"runtimeClasses": [{"name": "kata", "nodeSelector": {"pool": "a b"},
                          "artifacts": {"url": "registry.local/kata:1"}}]},
     "/kataManager/config/runtimeClasses/0/nodeSelector/pool"),
    ({"runtimeClasses": [{"name": "kata", "nodeSelector": {"Bad_Prefix/x": "1"},
                          "artifacts": {"url": "registry.local/kata:1"}}]},
     "/kataManager/config/runtimeClasses/0/nodeSelector"),
    ({"runtimeClassOverhead": {"podFixed": {"memory": "160MB"}}},
     "/kataManager/config/runtimeClassOverhead/podFixed/memory"),
    ({"artifactsDir": "/"}, "/kataManager/config/artifactsDir"),
], ids=["registry-dash", "registry-port", "selector-value", "selector-key", "quantity",
        "artifacts-root"])
@pytest.mark.integration
def test_helm_refuses_what_the_agent_would_refuse(values, fragment):
    helm = load_helm()
    config = merged(default_config().to_dict(), values)
    with pytest.raises(InvalidConfig) as agent:
        config_from_dict(config)
    assert agent.value.problems
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as caught:
        chart.render(merged(FULL, {"kataManager": {"config": values}}),
                     name=RELEASE, namespace=NAMESPACE)
    assert fragment in str(caught.value), str(caught.value)
