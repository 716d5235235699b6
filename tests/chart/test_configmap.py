"""The agent's config (configmap.yaml): what the chart writes, and that katamgr loads it."""

from __future__ import annotations

import pytest
import yaml
from chartvalues import CUSTOM_CLASSES, VALUE_SETS
from support.chartkit import FULL, RELEASE, host_mounts, merged, render


@pytest.mark.integration
def test_config_map_carries_the_kata_manager_config(chart):
    rendered = render(chart, CUSTOM_CLASSES)
    config = yaml.safe_load(rendered.get("ConfigMap", "-config")["data"]["config.yaml"])
    assert config == {
        "artifactsDir": "/var/lib/kata-artifacts",
        "runtimeClasses": CUSTOM_CLASSES["kataManager"]["config"]["runtimeClasses"],
        "containerd": {"configPath": "/etc/containerd/config.toml",
                       "socket": "/run/containerd/containerd.sock", "restartMode": "signal"},
        "runtimeClassOverhead": {"podFixed": {"memory": "160Mi", "cpu": "250m"}},
        "insecureRegistries": ["registry.local:5000"],
        "podResourceDeviceSources": ["device-plugin"],
    }
    # Optional keys stay out of the file unless set.
    default = yaml.safe_load(render(chart, FULL).get("ConfigMap", "-config")["data"]["config.yaml"])
    assert set(default) == {"artifactsDir", "runtimeClasses", "containerd", "podResourceDeviceSources"}
    pod = rendered.get("DaemonSet", "-sandbox-agent")["spec"]["template"]["spec"]
    config_volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert config_volume["configMap"]["name"] == f"{RELEASE}-config"
    mounts = host_mounts(rendered, "-sandbox-agent", "kata-manager")
    assert mounts["/host/var/lib/kata-artifacts"] == ("/var/lib/kata-artifacts", False)
    assert not any("nvidia-gpu-operator" in path for path in mounts)
    assert pod["imagePullSecrets"] == [{"name": "ghcr-creds"}]


@pytest.mark.parametrize("values", [FULL, CUSTOM_CLASSES, VALUE_SETS["example-mixed-cluster"],
                                    VALUE_SETS["air-gapped"], VALUE_SETS["example-air-gapped"]],
                         ids=["defaults", "custom-classes", "example-mixed-cluster", "air-gapped",
                              "example-air-gapped"])
@pytest.mark.integration
def test_katamgr_accepts_the_config_the_chart_writes(chart, values):
    from katamgr.config import parse_config

    text = render(chart, values).get("ConfigMap", "-config")["data"]["config.yaml"]
    config = parse_config(text, source="ConfigMap config.yaml")
    classes = chart.merge_values(values)["kataManager"]["config"]["runtimeClasses"]
    assert [rc.name for rc in config.runtime_classes] == [rc["name"] for rc in classes]
    assert config.containerd.restart_mode == "signal"


@pytest.mark.integration
def test_duplicate_runtime_class_names_are_refused(helm, chart):
    classes = [{"name": "kata-gpu", "artifacts": {"url": "registry.local/kata:1"}}] * 2
    with pytest.raises(helm.HelmError, match='"kata-gpu" appears twice'):
        render(chart, merged(FULL, {"kataManager": {"config": {"runtimeClasses": classes}}}))


def test_the_kata_config_reads_claims_exactly_when_the_dra_driver_serves_the_devices(chart):
    """katamgr renders [runtime] pod_resource_device_sources from this config key."""
    def sources(values):
        rendered = render(chart, values)
        return yaml.safe_load(rendered.get("ConfigMap", "-config")["data"]["config.yaml"])[
            "podResourceDeviceSources"]

    assert sources(FULL) == ["device-plugin"]
    assert sources({**FULL, "dra": {"enabled": True}}) == ["device-plugin", "dra"]


@pytest.mark.integration
@pytest.mark.parametrize("value", [False, True, "auto"])
def test_kata_deploy_reaches_the_agent_s_config(chart, value):
    """kataManager.config.kataDeploy (docs/devices.md#working-with-kata-deploy), false included."""
    from katamgr.config import parse_config

    text = render(chart, merged(FULL, {"kataManager": {"config": {"kataDeploy": value}}})) \
        .get("ConfigMap", "-config")["data"]["config.yaml"]
    assert yaml.safe_load(text)["kataDeploy"] == value
    assert parse_config(text).kata_deploy == value


SPLITS = [{"nodeSelector": {"matchLabels": {"pool": "dgx-mixed"}}, "vmGpus": "2"}, {"vmGpus": "index.6_7"}]


@pytest.mark.integration
def test_the_split_per_node_pool_reaches_the_agent_in_order(chart):
    from katamgr.config import parse_config

    text = render(chart, merged(FULL, {"sandboxWorkloads": {"splits": SPLITS}})).get(
        "ConfigMap", "-config")["data"]["config.yaml"]
    pools = parse_config(text, source="ConfigMap config.yaml").split_pools
    assert [(dict(p.match_labels), p.vm_gpus, p.where) for p in pools] == [
        ({"pool": "dgx-mixed"}, "2", "splits[0]"), ({}, "index.6_7", "splits[1]")]


@pytest.mark.integration
def test_a_bad_split_value_or_a_split_with_dra_is_refused_at_render(helm, chart):
    for bad in ({"vmGpus": "2:3"}, {"vmGpus": ""}, {"nodeSelector": {"matchLabels": {"pool": "a"}}},
                {"vmGpus": "2", "nodeSelector": {"pool": "a"}}):
        with pytest.raises(helm.HelmValuesError):
            render(chart, merged(FULL, {"sandboxWorkloads": {"splits": [bad]}}))
    # A split moves GPUs while the DRA driver's ResourceSlice may still offer a leaving one.
    with pytest.raises(helm.HelmError, match="sandboxWorkloads.splits with dra.enabled") as caught:
        render(chart, merged(FULL, {"sandboxWorkloads": {"splits": SPLITS}, "dra": {"enabled": True}}))
    assert "leave sandboxWorkloads.splits empty, or set dra.enabled=false" in str(caught.value)
