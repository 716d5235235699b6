"""Chart values beyond the templates' own: GPU Operator values carried over, the image block,
the CDI default and resource naming. Rendered by the real Helm v4 engine, with the
plumbing of tests/support/chartkit.py (fixtures in conftest.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from support.chartkit import (
    FULL,
    NAMESPACE,
    RELEASE,
    SANDBOX,
    Rendered,
    container,
    container_names,
    env_names,
    host_mounts,
    merged,
    render,
)
from support.paths import EXAMPLES

SANDBOX_KATA = {"sandboxWorkloads": {"enabled": True}, "kataManager": {"enabled": True}}
GPU_OPERATOR = yaml.safe_load((EXAMPLES / "values" / "gpu-operator.yaml").read_text())
# NVIDIA's images that a carried-over GPU Operator values file names; none may be used.
NVIDIA_IMAGES = ("k8s-kata-manager", "kubevirt-gpu-device-plugin", "nvidia-sandbox-device-plugin",
                 "k8s-device-plugin", "k8s-driver-manager", "k8s-cc-manager", "nvcr.io/nvidia/cuda")
# The webhook's Helm-made certificates are new on every render: renders compared object for
# object leave it out.
NO_WEBHOOK = {"isolation": {"webhook": {"enabled": False}}}
OPERAND_BLOCKS = ("kataManager", "vfioManager", "sandboxDevicePlugin", "kataSandboxDevicePlugin",
                  "devicePlugin")


def notes(chart, values: dict[str, Any]) -> str:
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))


def ignored(chart, values: dict[str, Any]) -> list[str]:
    """The keys NOTES.txt lists as ignored GPU Operator values ([] when it has no such line)."""
    prefix = "ignored GPU Operator values: "
    lines = [line for line in notes(chart, values).splitlines() if line.startswith(prefix)]
    assert len(lines) <= 1, lines
    return lines[0][len(prefix):].split(", ") if lines else []


def images(rendered: Rendered) -> set[str]:
    return {c["image"] for _, c in rendered.containers()}


def agent_args(rendered: Rendered) -> list[str]:
    return container(rendered, "-sandbox-agent", "kata-manager")["args"]


def plugin_args(rendered: Rendered) -> list[str]:
    return container(rendered, "-sandbox-agent", "sandbox-device-plugin")["args"]


def option(args: list[str], flag: str) -> str | None:
    """The value after flag, None when absent (and never given twice)."""
    assert args.count(flag) <= 1, args
    return args[args.index(flag) + 1] if flag in args else None


def pod(rendered: Rendered, suffix: str) -> dict[str, Any]:
    return rendered.get("DaemonSet", suffix)["spec"]["template"]["spec"]


def with_kata_plugin(**block: Any) -> dict[str, Any]:
    return merged(SANDBOX, {"kataSandboxDevicePlugin": block})


# --- CDI is on by default, as in the GPU Operator ------------------------------------------

@pytest.mark.integration
def test_cdi_is_on_by_default_for_the_kata_agent(chart):
    assert chart.merge_values({})["cdi"]["enabled"] is True
    rendered = render(chart, SANDBOX_KATA)
    args = agent_args(rendered)
    assert "--no-cdi" not in args and "--no-kata" not in args and "--no-vfio" not in args
    assert host_mounts(rendered, "-sandbox-agent", "kata-manager")["/host/var/run/cdi"] == \
        ("/var/run/cdi", False)
    # The device plugin reads the spec to hand out CDI names with each device.
    assert host_mounts(rendered, "-sandbox-agent", "sandbox-device-plugin")["/host/var/run/cdi"] == \
        ("/var/run/cdi", True)
    cdi_volume = next(v for v in pod(rendered, "-sandbox-agent")["volumes"] if v["name"] == "cdi")
    assert cdi_volume["hostPath"] == {"path": "/var/run/cdi", "type": "DirectoryOrCreate"}
    # Exactly what cdi.enabled=true said before it was the default (the webhook left out on
    # both sides: its Helm-made certificates are new on every render).
    assert render(chart, merged(SANDBOX_KATA, NO_WEBHOOK)).objects == \
        render(chart, merged(FULL, NO_WEBHOOK)).objects


@pytest.mark.integration
def test_sandbox_off_still_runs_no_cdi_writer(chart):
    rendered = render(chart, {})
    assert rendered.find("DaemonSet", "-sandbox-agent") is None
    assert not any("cdi" in m["mountPath"] for _, c in rendered.containers()
                   for m in c.get("volumeMounts", []))


# --- the image block: the only source of this chart's image ---------------------------------

@pytest.mark.integration
def test_the_image_block_sets_every_container_image(chart):
    assert chart.merge_values({})["image"]["tag"] == ""  # the chart's appVersion
    values = merged(FULL, {"image": {"repository": "registry.local:5000/mirror", "name": "ksm",
                                     "tag": "0.2.0-rc1", "pullPolicy": "Always",
                                     "pullSecrets": ["mirror-creds"]}})
    rendered = render(chart, values)
    assert {c["image"] for _, c in rendered.containers()} == {"registry.local:5000/mirror/ksm:0.2.0-rc1"}
    assert {c["imagePullPolicy"] for _, c in rendered.containers()} == {"Always"}
    assert len(list(rendered.containers())) == 3
    for ds in rendered.daemonsets():
        assert ds["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "mirror-creds"}]
    assert "Image of every agent: registry.local:5000/mirror/ksm:0.2.0-rc1" in notes(chart, values)


@pytest.mark.parametrize("block", OPERAND_BLOCKS)
@pytest.mark.integration
def test_no_gpu_operator_image_key_replaces_ours(chart, block):
    base = render(chart, FULL)
    nvidia = {"repository": "nvcr.io/nvidia/cloud-native", "image": "k8s-kata-manager",
              "version": "v0.2.3"}
    rendered = render(chart, merged(FULL, {block: nvidia}))
    assert images(rendered) == images(base)
    assert len(images(base)) == 1
    assert ignored(chart, merged(FULL, {block: nvidia})) == [
        f"{block}.repository", f"{block}.image", f"{block}.version"]


# --- a GPU Operator values file, carried over ---------------------------------------------

@pytest.mark.integration
def test_gpu_operator_values_render_with_our_image_only(chart):
    rendered = render(chart, GPU_OPERATOR)
    assert [ds["metadata"]["name"] for ds in rendered.daemonsets()] == [
        f"{RELEASE}-device-plugin", f"{RELEASE}-sandbox-agent"]
    assert container_names(rendered, "-sandbox-agent") == ["kata-manager", "sandbox-device-plugin"]
    assert images(rendered) == images(render(chart, {}))
    assert {image.rsplit(":", 1)[0] for image in images(rendered)} == {
        "ghcr.io/kata-sandbox-manager/kata-sandbox-manager"}
    # No NVIDIA operand image anywhere in what is applied to the cluster.
    text = json.dumps(rendered.objects)
    for name in NVIDIA_IMAGES:
        assert name not in text, name
    # Kata, vfio and CDI on: the agent runs every job.
    args = agent_args(rendered)
    assert not {"--no-kata", "--no-vfio", "--no-cdi"} & set(args)


@pytest.mark.integration
def test_gpu_operator_values_map_onto_our_containers(chart):
    rendered = render(chart, GPU_OPERATOR)
    # kataSandboxDevicePlugin.env P_GPU_ALIAS: the alias, for the plugin and for katamgr,
    # whose CDI specs are named like the advertised resources.
    plugin = container(rendered, "-sandbox-agent", "sandbox-device-plugin")
    assert option(plugin["args"], "--alias") == "pgpu"
    assert option(agent_args(rendered), "--alias") == "pgpu"
    assert option(plugin["args"], "--nvswitch-alias") is None
    assert "P_GPU_ALIAS" not in env_names(plugin)
    assert plugin["resources"] == GPU_OPERATOR["kataSandboxDevicePlugin"]["resources"]
    # kataManager.resources is {}: the agent takes vfioManager's; vfioManager.env configures
    # NVIDIA's k8s-driver-manager and stays out.
    agent = container(rendered, "-sandbox-agent", "kata-manager")
    assert agent["resources"] == GPU_OPERATOR["vfioManager"]["resources"]
    assert set(env_names(agent)) == {"NODE_NAME", "POD_NAMESPACE"}
    # hostNetwork of the GPU Operator blocks changes nothing: no pod of the chart joins the
    # host's network namespace (containerd signalling needs only the host's PIDs).
    assert "hostNetwork" not in pod(rendered, "-sandbox-agent")
    assert pod(rendered, "-sandbox-agent")["hostPID"] is True
    assert {c["imagePullPolicy"] for _, c in rendered.containers()} == {"IfNotPresent"}
    # Same runtime classes as written.
    config = yaml.safe_load(rendered.get("ConfigMap", "-config")["data"]["config.yaml"])
    assert config["runtimeClasses"] == GPU_OPERATOR["kataManager"]["config"]["runtimeClasses"]


@pytest.mark.integration
def test_notes_list_the_ignored_gpu_operator_values(chart):
    assert sorted(ignored(chart, GPU_OPERATOR)) == sorted([
        # NVIDIA's k8s-cc-manager image, whose job the agent does (ccManager is otherwise honoured).
        "ccManager.repository", "ccManager.image", "ccManager.version",
        *(f"{block}.{key}" for block in OPERAND_BLOCKS for key in ("repository", "image", "version")),
        "vfioManager.env", "vfioManager.driverManager",
        "devicePlugin.config", "devicePlugin.mps",
        "cdi.default", "cdi.nriPluginEnabled", "hostPaths.driverInstallDir",
    ])
    # args: [] and hostNetwork: false ask for nothing, so they are not listed; set, they are.
    asked = merged(GPU_OPERATOR, {"kataSandboxDevicePlugin": {"args": ["--v=4"]},
                                  "kataManager": {"hostNetwork": True}})
    assert {"kataSandboxDevicePlugin.args", "kataManager.hostNetwork"} <= set(ignored(chart, asked))


@pytest.mark.parametrize("values", [{}, SANDBOX, FULL,
                                    yaml.safe_load((EXAMPLES / "values" / "mixed-cluster.yaml").read_text()),
                                    yaml.safe_load((EXAMPLES / "values" / "air-gapped.yaml").read_text())],
                         ids=["defaults", "sandbox", "full", "example-mixed-cluster",
                              "example-air-gapped"])
@pytest.mark.integration
def test_notes_list_nothing_when_no_gpu_operator_value_is_ignored(chart, values):
    assert ignored(chart, values) == []
    assert "ignored" not in notes(chart, values)


# --- kataSandboxDevicePlugin and sandboxDevicePlugin: one container ---------------------------

@pytest.mark.parametrize(("values", "alias", "nvswitch"), [
    (with_kata_plugin(env=[{"name": "P_GPU_ALIAS", "value": "pgpu"}]), "pgpu", None),
    # Empty: model names, as NVIDIA's plugin does.
    (with_kata_plugin(env=[{"name": "P_GPU_ALIAS", "value": ""}]), None, None),
    (with_kata_plugin(env=[{"name": "NVSWITCH_ALIAS", "value": "nvswitch"}]), None, "nvswitch"),
    (with_kata_plugin(env=[{"name": "P_GPU_ALIAS", "value": "gpus"},
                           {"name": "NVSWITCH_ALIAS", "value": "nvsw"}]), "gpus", "nvsw"),
    # The chart's own sandboxDevicePlugin.alias wins.
    (merged(with_kata_plugin(env=[{"name": "P_GPU_ALIAS", "value": "gpus"}]),
            {"sandboxDevicePlugin": {"alias": "pgpu"}}), "pgpu", None),
    (merged(SANDBOX, {"sandboxDevicePlugin": {"alias": "pgpu"}}), "pgpu", None),
    # The same env names in the chart's own block are read too, and win over the GPU
    # Operator block's; an empty value there still means model names.
    (merged(with_kata_plugin(env=[{"name": "P_GPU_ALIAS", "value": "gpus"},
                                  {"name": "NVSWITCH_ALIAS", "value": "nvsw"}]),
            {"sandboxDevicePlugin": {"env": [{"name": "P_GPU_ALIAS", "value": ""},
                                             {"name": "NVSWITCH_ALIAS", "value": "switch"}]}}),
     None, "switch"),
], ids=["p-gpu-alias", "empty-alias", "nvswitch-alias", "both", "chart-alias-wins", "chart-alias",
        "chart-env-wins"])
@pytest.mark.integration
def test_aliases_reach_both_commands(chart, values, alias, nvswitch):
    rendered = render(chart, values)
    for args in (plugin_args(rendered), agent_args(rendered)):
        assert option(args, "--alias") == alias
        assert option(args, "--nvswitch-alias") == nvswitch


@pytest.mark.integration
def test_an_overridden_alias_is_listed(chart):
    values = merged(with_kata_plugin(env=[{"name": "P_GPU_ALIAS", "value": "gpus"}]),
                    {"sandboxDevicePlugin": {"alias": "pgpu"}})
    assert ignored(chart, values) == ["kataSandboxDevicePlugin.env P_GPU_ALIAS"]
    same = merged(with_kata_plugin(env=[{"name": "P_GPU_ALIAS", "value": "pgpu"}]),
                  {"sandboxDevicePlugin": {"alias": "pgpu"}})
    assert ignored(chart, same) == []
    env = merged(with_kata_plugin(env=[{"name": "NVSWITCH_ALIAS", "value": "nvsw"}]),
                 {"sandboxDevicePlugin": {"alias": "pgpu",
                                          "env": [{"name": "P_GPU_ALIAS", "value": "gpus"},
                                                  {"name": "NVSWITCH_ALIAS", "value": "sw"}]}})
    assert ignored(chart, env) == ["sandboxDevicePlugin.env P_GPU_ALIAS",
                                   "kataSandboxDevicePlugin.env NVSWITCH_ALIAS"]
    plugin = container(render(chart, env), "-sandbox-agent", "sandbox-device-plugin")
    assert not {"P_GPU_ALIAS", "NVSWITCH_ALIAS"} & set(env_names(plugin))


@pytest.mark.integration
def test_kata_plugin_env_resources_and_pull_settings_fill_in_for_the_chart_block(chart):
    values = merged(SANDBOX, {
        "kataSandboxDevicePlugin": {
            "env": [{"name": "LOG_LEVEL", "value": "debug"}, {"name": "TEAM", "value": "nvidia"},
                    {"name": "P_GPU_ALIAS", "value": "pgpu"}],
            "resources": {"limits": {"memory": "64Mi"}},
            "imagePullPolicy": "Always",
            "imagePullSecrets": ["ngc-secret"],
        },
        "sandboxDevicePlugin": {"env": [{"name": "TEAM", "value": "gpu"}]},
    })
    rendered = render(chart, values)
    plugin = container(rendered, "-sandbox-agent", "sandbox-device-plugin")
    assert [(e["name"], e.get("value")) for e in plugin["env"][2:]] == [
        ("TEAM", "gpu"), ("LOG_LEVEL", "debug")]
    assert plugin["resources"] == {"limits": {"memory": "64Mi"}}
    assert plugin["imagePullPolicy"] == "Always"
    assert container(rendered, "-sandbox-agent", "kata-manager")["imagePullPolicy"] == "IfNotPresent"
    assert pod(rendered, "-sandbox-agent")["imagePullSecrets"] == [{"name": "ngc-secret"}]
    assert "imagePullSecrets" not in pod(rendered, "-device-plugin")
    assert ignored(chart, values) == ["kataSandboxDevicePlugin.env TEAM"]

    # The chart's own block wins for the same container; what it overrides is listed.
    own = merged(values, {"sandboxDevicePlugin": {"resources": {"limits": {"memory": "128Mi"}},
                                                  "imagePullPolicy": "Never"}})
    plugin = container(render(chart, own), "-sandbox-agent", "sandbox-device-plugin")
    assert plugin["resources"] == {"limits": {"memory": "128Mi"}}
    assert plugin["imagePullPolicy"] == "Never"
    assert sorted(ignored(chart, own)) == ["kataSandboxDevicePlugin.env TEAM",
                                           "kataSandboxDevicePlugin.imagePullPolicy",
                                           "kataSandboxDevicePlugin.resources"]


@pytest.mark.integration
def test_vfio_manager_resources_and_pull_policy_fill_in_for_kata_manager(chart):
    vfio = {"vfioManager": {"resources": {"requests": {"cpu": "50m"}}, "imagePullPolicy": "Always",
                            "imagePullSecrets": ["ngc-secret"]}}
    rendered = render(chart, merged(FULL, vfio))
    agent = container(rendered, "-sandbox-agent", "kata-manager")
    assert agent["resources"] == {"requests": {"cpu": "50m"}}
    assert agent["imagePullPolicy"] == "Always"
    assert pod(rendered, "-sandbox-agent")["imagePullSecrets"] == [{"name": "ngc-secret"}]

    own = merged(FULL, vfio, {"kataManager": {"resources": {"requests": {"cpu": "100m"}},
                                              "imagePullPolicy": "Never",
                                              "imagePullSecrets": ["ngc-secret", "mirror"]}})
    rendered = render(chart, own)
    agent = container(rendered, "-sandbox-agent", "kata-manager")
    assert agent["resources"] == {"requests": {"cpu": "100m"}}
    assert agent["imagePullPolicy"] == "Never"
    assert pod(rendered, "-sandbox-agent")["imagePullSecrets"] == [{"name": "ngc-secret"},
                                                                   {"name": "mirror"}]
    assert sorted(ignored(chart, own)) == ["vfioManager.imagePullPolicy", "vfioManager.resources"]


@pytest.mark.integration
def test_device_plugin_pull_settings(chart):
    rendered = render(chart, {"devicePlugin": {"imagePullPolicy": "Always",
                                               "imagePullSecrets": ["ngc-secret"]},
                              "image": {"pullSecrets": ["mirror"]}})
    plugin = container(rendered, "-device-plugin", "device-plugin")
    assert plugin["imagePullPolicy"] == "Always"
    assert pod(rendered, "-device-plugin")["imagePullSecrets"] == [{"name": "mirror"},
                                                                   {"name": "ngc-secret"}]


@pytest.mark.parametrize(("values", "runs"), [
    (SANDBOX, True),
    (with_kata_plugin(enabled=False), False),
    (merged(SANDBOX, {"sandboxDevicePlugin": {"enabled": False}}), False),
    (merged(with_kata_plugin(enabled=True), {"sandboxDevicePlugin": {"enabled": False}}), False),
], ids=["both-on", "kata-plugin-off", "sandbox-plugin-off", "sandbox-plugin-off-kata-on"])
@pytest.mark.integration
def test_either_enabled_switch_turns_the_sandbox_plugin_off(chart, values, runs):
    rendered = render(chart, values)
    assert ("sandbox-device-plugin" in container_names(rendered, "-sandbox-agent")) is runs
    said = "The passthrough device plugin is off: kataSandboxDevicePlugin.enabled=false."
    assert (said in notes(chart, values)) is (values == with_kata_plugin(enabled=False))


# --- resource naming --------------------------------------------------------------------------

@pytest.mark.parametrize("naming", ["nvidia", "compact"])
@pytest.mark.integration
def test_resource_naming_reaches_both_commands(chart, naming):
    values = FULL if naming == "nvidia" else merged(FULL, {"sandboxDevicePlugin": {"resourceNaming": naming}})
    rendered = render(chart, values)
    assert option(agent_args(rendered), "--resource-naming") == naming
    assert option(plugin_args(rendered), "--resource-naming") == naming
    # The container plugin advertises nvidia.com/gpu: no model names to make.
    assert "--resource-naming" not in container(rendered, "-device-plugin", "device-plugin")["args"]
    # Without the sandbox device plugin, katamgr still names its CDI specs.
    agent_only = render(chart, merged(values, {"sandboxDevicePlugin": {"enabled": False}}))
    assert option(agent_args(agent_only), "--resource-naming") == naming


@pytest.mark.parametrize("values", [
    GPU_OPERATOR,
    merged(FULL, {"sandboxDevicePlugin": {"resourceNaming": "compact", "alias": "pgpu"},
                  "kataSandboxDevicePlugin": {"env": [{"name": "NVSWITCH_ALIAS", "value": "nvswitch"}]}}),
], ids=["gpu-operator", "compact-aliases"])
def test_both_commands_understand_the_naming_arguments(chart, values):
    from katamgr import cli as katamgr_cli
    from sandbox_plugin import cli as plugin_cli

    rendered = render(chart, values)
    agent = katamgr_cli.build_parser().parse_args(agent_args(rendered))
    plugin = plugin_cli.build_parser().parse_args(
        [a.replace("$(NODE_NAME)", "gpu-node-1") for a in plugin_args(rendered)])
    for parsed in (agent, plugin):
        assert (parsed.resource_naming, parsed.alias, parsed.nvswitch_alias) == (
            option(plugin_args(rendered), "--resource-naming"),
            option(plugin_args(rendered), "--alias"),
            option(plugin_args(rendered), "--nvswitch-alias"))
    assert (agent.resource_naming, agent.alias, agent.nvswitch_alias) == \
        (plugin.resource_naming, plugin.alias, plugin.nvswitch_alias)


# --- refused values ---------------------------------------------------------------------------

@pytest.mark.parametrize("values", [
    {"sandboxWorkloads": {"enabled": True, "mode": "kubevirt"}},
    merged(GPU_OPERATOR, {"sandboxWorkloads": {"mode": "kubevirt"}}),
], ids=["sandbox-on", "gpu-operator"])
@pytest.mark.integration
def test_kubevirt_mode_is_refused_naming_kubevirt(helm, chart, values):
    with pytest.raises(helm.HelmError) as caught:
        render(chart, values)
    message = str(caught.value)
    assert "sandboxWorkloads.mode=kubevirt" in message, message
    assert "KubeVirt" in message and "Kata Containers only" in message, message
    assert "NVIDIA GPU Operator" in message, message
    # helm lint turns `fail` into a log line (so charts with required values lint); install,
    # upgrade and template all stop here.


@pytest.mark.integration
def test_kubevirt_mode_with_sandbox_workloads_off_is_listed_as_ignored(chart):
    # The GPU Operator's own defaults: sandbox workloads off, mode kubevirt. No sandbox
    # operand runs, so the mode chooses nothing.
    text = notes(chart, {"sandboxWorkloads": {"mode": "kubevirt"}})
    assert "sandboxWorkloads.mode" in text.split("ignored GPU Operator values:")[1]


@pytest.mark.integration
def test_kata_mode_is_the_default(chart):
    assert chart.merge_values({})["sandboxWorkloads"]["mode"] == "kata"
    kata = merged(FULL, {"sandboxWorkloads": {"mode": "kata"}}, NO_WEBHOOK)
    assert render(chart, kata).objects == render(chart, merged(FULL, NO_WEBHOOK)).objects


@pytest.mark.parametrize(("values", "fragments"), [
    ({"sandboxWorkloads": {"mode": "vm"}}, ["/sandboxWorkloads/mode", "kata", "kubevirt"]),
    ({"kataSandboxDevicePlugin": {"alias": "pgpu"}}, ["/kataSandboxDevicePlugin", "'alias'"]),
    ({"cdi": {"nriPlugin": True}}, ["/cdi", "'nriPlugin'"]),
    ({"cdi": {"default": "yes"}}, ["/cdi/default", "boolean"]),
    ({"ccManager": "on"}, ["/ccManager", "object"]),
    ({"vfioManager": {"driverManager": {"args": []}}}, ["/vfioManager/driverManager", "'args'"]),
    ({"hostPaths": {"kubeletDir": "/var/lib/kubelet"}}, ["/hostPaths", "'kubeletDir'"]),
    ({"hostPaths": {"kubeletRootDir": "var/lib/k0s/kubelet"}}, ["/hostPaths/kubeletRootDir"]),
    ({"hostPaths": {"driverInstallDir": "run/nvidia/driver"}}, ["/hostPaths/driverInstallDir"]),
    # A key neither chart knows (the GPU Operator's blocks are accepted whole).
    ({"drivers": {"enabled": False}}, ["'drivers'", "not allowed"]),
    ({"image": {"version": "0.1.0"}}, ["/image", "'version'"]),
    ({"image": {"tag": "v1 beta"}}, ["/image/tag"]),
    ({"kataManager": {"imagePullPolicy": "Sometimes"}}, ["/kataManager/imagePullPolicy"]),
    ({"kataManager": {"args": "--v=4"}}, ["/kataManager/args", "array"]),
    ({"sandboxDevicePlugin": {"resourceNaming": "short"}},
     ["/sandboxDevicePlugin/resourceNaming", "nvidia", "compact"]),
    ({"sandboxDevicePlugin": {"alias": "1gpu"}}, ["/sandboxDevicePlugin/alias", "1gpu"]),
    ({"kataSandboxDevicePlugin": {"env": [{"name": "P_GPU_ALIAS", "value": "p.gpu"}]}},
     ["/kataSandboxDevicePlugin/env/0/value", "p.gpu"]),
    ({"sandboxDevicePlugin": {"env": [{"name": "TEAM", "value": "gpu"},
                                      {"name": "P_GPU_ALIAS", "value": "-gpu"}]}},
     ["/sandboxDevicePlugin/env/1/value", "-gpu"]),
    ({"kataSandboxDevicePlugin": {"env": [{"name": "NVSWITCH_ALIAS",
                                           "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]}},
     ["/kataSandboxDevicePlugin/env/0", "'value'"]),
], ids=["unknown-mode", "unknown-kata-plugin-key", "unknown-cdi-key", "cdi-default-not-bool",
        "cc-manager-not-a-map", "unknown-driver-manager-key", "unknown-host-path",
        "relative-kubelet-root-dir", "relative-driver-install-dir", "misspelt-gpu-operator-block", "unknown-image-key",
        "bad-image-tag", "bad-pull-policy", "args-not-a-list", "unknown-resource-naming",
        "alias-starts-with-digit", "bad-p-gpu-alias", "bad-chart-env-alias", "alias-from-value-from"])
@pytest.mark.integration
def test_schema_still_refuses_what_no_one_knows(helm, chart, values, fragments):
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
