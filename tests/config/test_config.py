"""The kata manager config: GPU Operator shape, defaults, and every problem reported at once."""

from __future__ import annotations

import textwrap

import pytest
import yaml
from configkit import BAD_CASES
from support.paths import EXAMPLES

from gpunode.errors import ConfigError
from gpunode.policy.selection import NvswitchRule
from katamgr.artifacts.refs import LayoutRef, RegistryRef
from katamgr.config import (
    DEFAULT_ARTIFACTS_DIR,
    DEFAULT_GPU_ARTIFACTS,
    DEFAULT_SNP_ARTIFACTS,
    InvalidConfig,
    config_from_dict,
    default_config,
    load_config,
    parse_config,
)

DIGEST = "sha256:" + "0123456789abcdef" * 4


def problems_of(data) -> list[str]:
    with pytest.raises(InvalidConfig) as caught:
        config_from_dict(data)
    return caught.value.problems


def test_default_config_matches_the_gpu_operator_defaults():
    config = default_config()
    assert config.artifacts_dir == DEFAULT_ARTIFACTS_DIR
    assert [rc.name for rc in config.runtime_classes] == [
        "kata-qemu-nvidia-gpu", "kata-qemu-nvidia-gpu-snp"]
    gpu, snp = config.runtime_classes
    assert gpu.artifacts.url == DEFAULT_GPU_ARTIFACTS
    assert snp.artifacts.url == DEFAULT_SNP_ARTIFACTS
    # Every class schedules only where the agent installed it (its offer label, kataclasses.offer_label).
    assert gpu.scheduling_node_selector == {"nvidia.com/gpu.workload.config": "vm-passthrough",
                                            "runtimeclass.kata-sandbox-manager.io/kata-qemu-nvidia-gpu": "true"}
    # A confidential class (-snp) schedules only where the GPUs are CC-ready too.
    assert snp.scheduling_node_selector == {"nvidia.com/cc.capable": "true", "nvidia.com/cc.ready.state": "true",
                                            "runtimeclass.kata-sandbox-manager.io/kata-qemu-nvidia-gpu-snp": "true"}
    assert config.containerd.restart_mode == "signal"
    assert config.containerd.pod_annotations == ("io.katacontainers.*",)
    assert load_config(None) == config


def test_shipped_example_configs_load():
    assert load_config(EXAMPLES / "configs" / "kata-manager.yaml") == default_config()
    air_gapped = load_config(EXAMPLES / "configs" / "air-gapped.yaml")
    sources = [rc.artifacts.source for rc in air_gapped.runtime_classes]
    assert all(isinstance(s, LayoutRef) for s in sources)
    assert str(sources[0].path) == "/var/lib/kata-artifacts/kata-gpu-artifacts"
    assert sources[0].tag == "ubuntu22.04-535.54.03"


def test_gpu_operator_values_shape_loads_with_our_additions():
    config = parse_config(textwrap.dedent("""\
        artifactsDir: /opt/nvidia-gpu-operator/artifacts/runtimeclasses
        runtimeClasses:
          - name: kata-nvidia-gpu
            nodeSelector: {}
            artifacts:
              url: nvcr.io/nvidia/cloud-native/kata-gpu-artifacts:ubuntu22.04-535.54.03
              pullSecret: ngc-secret
        containerd:
          version: 3
          restartMode: systemd
          configPath: /etc/containerd/config.toml
        runtimeClassOverhead: {podFixed: {memory: 160Mi, cpu: 250m}}
        insecureRegistries: ["registry.lab:5000"]
        """))
    rc = config.runtime_classes[0]
    assert rc.artifacts.pull_secret == "ngc-secret"
    assert config.containerd.version == 3
    assert config.containerd.restart_mode == "systemd"
    assert config.overhead_pod_fixed == {"memory": "160Mi", "cpu": "250m"}
    assert config.insecure_registries == ("registry.lab:5000",)


def test_missing_optional_sections_take_defaults_and_round_trip():
    config = config_from_dict({})
    assert config == default_config()
    assert config_from_dict(config.to_dict()) == config
    empty = config_from_dict({"runtimeClasses": []})
    assert empty.runtime_classes == ()


def test_artifact_url_forms_are_accepted():
    urls = [DEFAULT_GPU_ARTIFACTS, f"127.0.0.1:5000/kata/gpu@{DIGEST}",
            f"localhost/kata/gpu:v1@{DIGEST}", "oci-layout:///srv/layouts/kata",
            "oci-layout:///srv/kata:v2"]
    config = config_from_dict({"runtimeClasses": [
        {"name": f"kata-{i}", "artifacts": {"url": url}} for i, url in enumerate(urls)]})
    sources = [rc.artifacts.source for rc in config.runtime_classes]
    assert isinstance(sources[0], RegistryRef) and sources[0].registry == "nvcr.io"
    assert sources[1].digest == DIGEST
    assert isinstance(sources[4], LayoutRef) and str(sources[4].path) == "/srv/kata"
    assert sources[4].tag == "v2"


@pytest.mark.parametrize("data, fragment", BAD_CASES, ids=[f"case{i}" for i in range(len(BAD_CASES))])
def test_each_invalid_entry_is_named(data, fragment):
    problems = problems_of(data)
    assert any(fragment in p for p in problems), problems


def test_duplicate_names_name_both_indexes():
    data = {"runtimeClasses": [
        {"name": "kata-a", "artifacts": {"url": DEFAULT_GPU_ARTIFACTS}},
        {"name": "kata-b", "artifacts": {"url": DEFAULT_GPU_ARTIFACTS}},
        {"name": "kata-a", "artifacts": {"url": DEFAULT_SNP_ARTIFACTS}},
    ]}
    assert problems_of(data) == [
        'runtimeClasses[2].name "kata-a" duplicates runtimeClasses[0].name; '
        "runtime class names must be unique"
    ]


def test_every_problem_is_reported_at_once():
    text = textwrap.dedent("""\
        runtimeClases: []
        artifactsDir: relative/dir
        runtimeClasses:
          - name: Kata_GPU
            artifacts: {url: "nvidia/kata:v1"}
          - name: kata-ok
            nodeSelector: {nvidia.com/cc.capable: true}
            artifacts: {url: "oci-layout:///srv/kata:v1"}
        containerd: {restartMode: reboot}
        runtimeClassOverhead: {podFixed: {memory: lots}}
        """)
    with pytest.raises(ConfigError) as caught:
        parse_config(text, source="/etc/kata/config.yaml")
    message = str(caught.value)
    assert "/etc/kata/config.yaml" in message
    assert "7 problems" in message
    for fragment in ("runtimeClases", "artifactsDir", 'runtimeClasses[0].name "Kata_GPU"',
                     "runtimeClasses[0].artifacts.url", "runtimeClasses[1].nodeSelector",
                     "containerd.restartMode", "runtimeClassOverhead.podFixed"):
        assert fragment in message
    assert caught.value.exit_code == 2


def test_yaml_errors_and_duplicate_keys_name_the_source(tmp_path):
    with pytest.raises(ConfigError, match=r"<string> is not valid YAML"):
        parse_config("runtimeClasses: [")
    path = tmp_path / "dup.yaml"
    path.write_text("artifactsDir: /a\nartifactsDir: /b\n")
    with pytest.raises(ConfigError, match=r"dup.yaml is not valid YAML.*duplicate key \"artifactsDir\""):
        load_config(path)


def test_unreadable_or_huge_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read kata manager config .*missing.yaml"):
        load_config(tmp_path / "missing.yaml")
    huge = tmp_path / "huge.yaml"
    huge.write_text("# " + "x" * (1 << 20))
    with pytest.raises(ConfigError, match="larger than"):
        load_config(huge)


def test_yaml_numbers_in_overhead_become_quantities():
    config = config_from_dict({"runtimeClassOverhead": {"podFixed": {"cpu": 1, "memory": "1Gi"}}})
    assert config.overhead_pod_fixed == {"cpu": "1", "memory": "1Gi"}


def test_example_config_is_what_the_helm_values_would_render():
    # The default example doubles as documentation: it must list every key we accept.
    data = yaml.safe_load((EXAMPLES / "configs" / "kata-manager.yaml").read_text())
    assert set(data) == set(default_config().to_dict())
    assert set(data["containerd"]) == set(default_config().to_dict()["containerd"])


# --- devices: which PCI devices are passthrough devices ---------------------------------


def test_devices_default_is_the_default_selection():
    from gpunode.policy.selection import DEFAULT_SELECTION

    assert default_config().devices.selection == DEFAULT_SELECTION
    assert config_from_dict({"devices": None}).devices.selection == DEFAULT_SELECTION


def test_devices_are_normalised_and_quoted_by_origin():
    config = parse_config(textwrap.dedent("""\
        devices:
          include: [{ids: "1234:11E8", resource: example.com/edu}]
          exclude: ["0000:00:0A.0", "10DE:1EB8"]
    """))
    assert config.to_dict()["devices"] == {
        "include": [{"ids": "1234:11e8", "resource": "example.com/edu"}],
        "exclude": ["0000:00:0a.0", "10de:1eb8"],
        "nvswitches": "auto",
        "kataVersion": "",
        "nvlinkFabric": "auto",
        "fabricManager": {"address": "127.0.0.1:6666", "library": "libnvfm.so.1", "gpuModuleIds": ""},
        "linkPolicy": "degrade",
    }
    selection = config.devices.selection
    assert [str(r) for r in selection.include] == ["1234:11e8=example.com/edu"]
    assert [r.value for r in selection.exclude] == ["0000:00:0a.0", "10de:1eb8"]
    assert {r.origin for r in selection.include} == {"config devices.include"}
    assert {r.origin for r in selection.exclude} == {"config devices.exclude"}


def test_one_device_under_two_resources_is_refused_naming_both():
    assert problems_of({"devices": {"include": [
        {"ids": "1234:11e8", "resource": "example.com/edu"},
        {"ids": "1234:11E8", "resource": "example.com/other"},
    ]}}) == ['devices.include includes "1234:11e8" twice, as "example.com/edu" and '
             '"example.com/other"; a device is advertised under one resource']


def test_confidential_runtime_classes_select_cc_ready_nodes():
    config = parse_config("""
runtimeClasses:
  - {name: kata-qemu-nvidia-gpu-tdx, artifacts: {url: "registry.example.com/a:1"}}
  - {name: my-cc-class, confidential: true, nodeSelector: {team: ml}, artifacts: {url: "registry.example.com/a:1"}}
  - {name: kata-qemu-nvidia-gpu-snp, confidential: false, artifacts: {url: "registry.example.com/a:1"}}
  - {name: kata-qemu-nvidia-gpu, artifacts: {url: "registry.example.com/a:1"}}
""")
    tdx, mine, not_cc, plain = config.runtime_classes
    offered = "runtimeclass.kata-sandbox-manager.io/"
    assert tdx.scheduling_node_selector == {"nvidia.com/gpu.workload.config": "vm-passthrough",
                                            "nvidia.com/cc.ready.state": "true", offered + tdx.name: "true"}
    assert mine.scheduling_node_selector == {"team": "ml", "nvidia.com/cc.ready.state": "true",
                                             offered + "my-cc-class": "true"}
    assert not_cc.scheduling_node_selector == {"nvidia.com/gpu.workload.config": "vm-passthrough",
                                               offered + not_cc.name: "true"}
    assert "nvidia.com/cc.ready.state" not in plain.scheduling_node_selector


@pytest.mark.parametrize(("value", "mode", "takes"), [("auto", "auto", False), ("true", True, True),
                                                     ("false", False, False)])
def test_nvswitches_are_opted_into(value, mode, takes):
    """NVSwitches pass through where the node's Kata cold-plugs them, or at the operator's word."""
    config = parse_config(f"devices: {{nvswitches: {value}, kataVersion: 3.25.0}}\n")
    selection, typed = config.devices.selection, NvswitchRule(config.devices.kata_release)
    assert (selection.nvswitches, typed.takes_nvswitches(selection.nvswitches)) == (mode, takes)
    assert str(typed.kata) == "Kata 3.25.0"
    assert parse_config(yaml.safe_dump(config.to_dict())).devices == config.devices  # round trip
    newer = parse_config("devices: {kataVersion: '4.1.0'}\n").devices
    assert NvswitchRule(newer.kata_release).takes_nvswitches(newer.selection.nvswitches)


def test_bad_nvswitch_and_kata_and_source_values_are_named():
    with pytest.raises(ConfigError) as err:
        parse_config("devices: {nvswitches: maybe, kataVersion: latest}\n"
                     "podResourceDeviceSources: [dra, dra, gpu]\n")
    text = str(err.value)
    assert '"maybe" is not auto, true or false' in text
    assert '"latest" is not a Kata Containers release such as 3.25.0' in text
    assert '"gpu" is not a PodResources device source' in text


def test_pod_resource_device_sources_default_to_the_device_plugin():
    assert parse_config("{}\n").pod_resource_device_sources == ("device-plugin",)
    both = parse_config("podResourceDeviceSources: [device-plugin, dra]\n")
    assert both.pod_resource_device_sources == ("device-plugin", "dra")
    with pytest.raises(ConfigError, match="lists a source twice"):
        parse_config("podResourceDeviceSources: [dra, dra]\n")


def test_split_pools_are_parsed_in_order_and_a_bad_one_is_named_with_the_fix():
    config = parse_config("splits:\n- {nodeSelector: {matchLabels: {pool: dgx-mixed}}, vmGpus: '2'}\n"
                          "- {vmGpus: index.6_7}\n")
    pools = config.split_pools
    assert [(dict(p.match_labels), p.vm_gpus, p.where) for p in pools] == [
        ({"pool": "dgx-mixed"}, "2", "splits[0]"), ({}, "index.6_7", "splits[1]")]
    assert parse_config(yaml.safe_dump(config.to_dict())).splits == config.splits  # round trip
    for bad, said in (("2:3", '"2:3" is not a Kubernetes label value'),
                      ("index.x", "\"index.x\" has the item 'x', which is not a number or a range like 4-7"),
                      ("gpus.2", "is neither a count nor a selector index., pci. or model.")):
        with pytest.raises(ConfigError) as err:
            parse_config(f"splits: [{{vmGpus: '{bad}'}}]\n")
        assert "splits[0].vmGpus" in str(err.value) and said in str(err.value), str(err.value)
        assert "give a count or a selector (2, all, index.6_7" in str(err.value)
    with pytest.raises(ConfigError, match=r"splits\[0\].vmGpus is missing"):
        parse_config("splits: [{nodeSelector: {matchLabels: {pool: a}}}]\n")
    assert not parse_config("{}\n").dra and parse_config("podResourceDeviceSources: [dra]\n").dra
