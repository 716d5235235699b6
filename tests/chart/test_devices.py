"""The chart's devices value: which PCI devices are passed through, given to the agent and the
sandbox device plugin alike as --include-device/--exclude-device, and checked at render time."""

from __future__ import annotations

import pytest
from support.chartkit import FULL, NAMESPACE, RELEASE, container, host_mounts, merged, render

from gpunode.policy.selection import DEFAULT_SELECTION
from gpunode.services import options
from gpunode.services.nvlinkfabric import FabricSettings
from katamgr.cli import build_parser
from sandbox_plugin.cli import parse_args
from sandbox_plugin.dra.cli import build_parser as dra_parser

DEVICES = {"devices": {
    "include": [{"ids": "1234:11e8", "resource": "example.com/edu"},
                {"ids": "1234:1111", "resource": "example.com/vga"}],
    "exclude": ["0000:00:01.0", "10de:1eb8"],
}}
FLAGS = ["--include-device", "1234:11e8=example.com/edu", "--include-device", "1234:1111=example.com/vga",
         "--exclude-device", "0000:00:01.0", "--exclude-device", "10de:1eb8"]


def selection_flags(args: list[str]) -> list[str]:
    out = []
    for flag, value in zip(args, args[1:], strict=False):
        if flag in ("--include-device", "--exclude-device"):
            out += [flag, value]
    return out


@pytest.mark.integration
def test_both_containers_get_the_same_selection(chart):
    rendered = render(chart, merged(FULL, DEVICES))
    agent = container(rendered, "-sandbox-agent", "kata-manager")["args"]
    plugin = container(rendered, "-sandbox-agent", "sandbox-device-plugin")["args"]
    assert selection_flags(agent) == selection_flags(plugin) == FLAGS
    # Both commands take what the chart renders.
    katamgr = build_parser().parse_args(agent)
    assert katamgr.include_device == ["1234:11e8=example.com/edu", "1234:1111=example.com/vga"]
    assert parse_args(plugin).exclude_device == ["0000:00:01.0", "10de:1eb8"]
    # The uninstall hook's revert undoes what was recorded: it gets no selection.
    for _ds, c in rendered.containers():
        if c["name"] not in ("kata-manager", "sandbox-device-plugin"):
            assert not selection_flags(c.get("args") or []), c["name"]


@pytest.mark.integration
def test_the_default_selects_as_before(chart):
    rendered = render(chart, FULL)
    for name in ("kata-manager", "sandbox-device-plugin"):
        args = container(rendered, "-sandbox-agent", name)["args"]
        assert not selection_flags(args)
        # The values as values.yaml writes them; an empty kataVersion: the release found on the node.
        assert nvswitch_flags(args) == ["--nvswitches", "auto", "--kata-version", ""]
    assert chart.merge_values({})["devices"] == {
        "include": [], "exclude": [], "nvswitches": "auto", "kataVersion": "", "nvlinkFabric": "auto",
        "fabricManager": {"address": "127.0.0.1:6666", "library": "libnvfm.so.1", "gpuModuleIds": ""},
        "linkPolicy": "degrade"}
    # Passed through, the defaults select and decide as no flag at all would.
    agent = build_parser().parse_args(container(rendered, "-sandbox-agent", "kata-manager")["args"])
    plugin = parse_args(container(rendered, "-sandbox-agent", "sandbox-device-plugin")["args"])
    for args in (agent, plugin):
        assert options.selection_from(args) == DEFAULT_SELECTION
        assert options.fabric_from(args) == FabricSettings()


def test_the_nvlink_fabric_reaches_katamgr_the_device_plugin_and_the_dra_driver(chart):
    """All three decide the node's model alike (docs/devices.md, "NVLink fabric")."""
    values = merged(FULL, {"devices": {"nvlinkFabric": "sharedNvswitch", "fabricManager": {
        "address": "/run/nvidia-fabricmanager/fm.sock", "library": "/usr/lib/x86_64-linux-gnu/libnvfm.so.1",
        "gpuModuleIds": "1=0000:1b:00.0"}}})
    rendered = render(chart, values)
    agent = build_parser().parse_args(container(rendered, "-sandbox-agent", "kata-manager")["args"])
    plugin = parse_args(container(rendered, "-sandbox-agent", "sandbox-device-plugin")["args"])
    for args in (agent, plugin):
        assert (args.nvlink_fabric, args.fabric_manager_address, args.fabric_manager_library,
                args.gpu_module_ids) == ("sharedNvswitch", "/run/nvidia-fabricmanager/fm.sock",
                                         "/usr/lib/x86_64-linux-gnu/libnvfm.so.1", "1=0000:1b:00.0")
    with_dra = render(chart, merged(values, {"dra": {"enabled": True}}))
    driver = dra_parser().parse_args(container(with_dra, "-sandbox-agent", "dra-driver")["args"])
    assert (driver.nvlink_fabric, driver.fabric_manager_address) == ("sharedNvswitch", "/run/nvidia-fabricmanager/fm.sock")
    # The DRA driver activates partitions at NodePrepareResources: it reaches FM and keeps its record too.
    dra_mounts = host_mounts(with_dra, "-sandbox-agent", "dra-driver")
    assert dra_mounts["/host/var/lib/kata-sandbox-manager"] == ("/var/lib/kata-sandbox-manager", False)
    assert dra_mounts["/host/run/nvidia-fabricmanager"] == ("/run/nvidia-fabricmanager", True)
    # The plugin reaches FM's socket and library, and keeps its record of active partitions.
    mounts = host_mounts(rendered, "-sandbox-agent", "sandbox-device-plugin")
    assert mounts["/host/var/lib/kata-sandbox-manager"] == ("/var/lib/kata-sandbox-manager", False)
    assert mounts["/host/run/nvidia-fabricmanager"] == ("/run/nvidia-fabricmanager", True)
    assert mounts["/host/usr/lib/x86_64-linux-gnu"] == ("/usr/lib/x86_64-linux-gnu", True)
    assert not [m for m in host_mounts(render(chart, FULL), "-sandbox-agent", "sandbox-device-plugin")
                if "fabricmanager" in m or m == "/host/var/lib/kata-sandbox-manager"]  # handback/ stays
    # katamgr's plan asks FM too (the model, the partitions, the Event where neither model
    # holds): read-only, its own state dir mounted as before. (Without these the agent finds no
    # FM and warns NVLinkFabricUnavailable on a node whose plugin uses it: tests/node/test_node_nvlink.py.)
    agent_mounts = host_mounts(rendered, "-sandbox-agent", "kata-manager")
    assert agent_mounts["/host/run/nvidia-fabricmanager"] == ("/run/nvidia-fabricmanager", True)
    assert agent_mounts["/host/usr/lib/x86_64-linux-gnu"] == ("/usr/lib/x86_64-linux-gnu", True)
    assert agent_mounts["/host/var/lib/kata-sandbox-manager"] == ("/var/lib/kata-sandbox-manager", False)
    agent_only = render(chart, merged(values, {"sandboxDevicePlugin": {"enabled": False}}))
    assert host_mounts(agent_only, "-sandbox-agent", "kata-manager")["/host/run/nvidia-fabricmanager"] \
        == ("/run/nvidia-fabricmanager", True)


def nvswitch_flags(args: list[str]) -> list[str]:
    out = []
    for flag, value in zip(args, args[1:], strict=False):
        if flag in ("--nvswitches", "--kata-version"):
            out += [flag, value]
    return out


@pytest.mark.integration
@pytest.mark.parametrize(("value", "mode"), [(True, "true"), (False, "false"), ("auto", "auto")])
def test_nvswitches_and_the_kata_release_reach_both_containers(chart, value, mode):
    """Kata before 4.1 fails every sandbox given an NVSwitch: the operator opts in (true), and
    says which Kata the nodes run; the agent and the plugin (or the DRA driver) get both."""
    values = merged(FULL, {"devices": {"nvswitches": value, "kataVersion": "3.25.0"}})
    for dra in (False, True):
        rendered = render(chart, merged(values, {"dra": {"enabled": dra}}))
        plugin = "dra-driver" if dra else "sandbox-device-plugin"
        agent = container(rendered, "-sandbox-agent", "kata-manager")["args"]
        served = container(rendered, "-sandbox-agent", plugin)["args"]
        assert nvswitch_flags(agent) == nvswitch_flags(served) == [
            "--nvswitches", mode, "--kata-version", "3.25.0"]
        # The value's own spelling, taken by both programs as the Selection holds it.
        parse = dra_parser().parse_args if dra else parse_args
        assert parse(served).nvswitches == value
    katamgr = build_parser().parse_args(agent)
    assert (katamgr.nvswitches, katamgr.kata_version) == (value, "3.25.0")
    assert options.selection_from(katamgr).nvswitches == value


@pytest.mark.parametrize(("values", "fragments"), [
    ({"devices": {"include": [{"ids": "1234:11e8", "resource": "edu"}]}},
     ["/devices/include/0/resource", "edu"]),
    ({"devices": {"include": [{"ids": "1234:11e8"}]}}, ["/devices/include/0", "'resource'"]),
    ({"devices": {"include": [{"ids": "123:11e8", "resource": "example.com/edu"}]}},
     ["/devices/include/0/ids", "123:11e8"]),
    ({"devices": {"exclude": ["01:00.0"]}}, ["/devices/exclude/0", "01:00.0"]),
    ({"devices": {"exclude": "10de:1eb8"}}, ["/devices/exclude", "array"]),
    ({"devices": {"exlude": []}}, ["/devices", "'exlude'"]),
    ({"devices": {"nvswitches": "yes"}}, ["/devices/nvswitches", "want boolean"]),
    ({"devices": {"kataVersion": "latest"}}, ["/devices/kataVersion", "latest"]),
    # In kataManager.config only the agent would see it: the chart takes the top-level value.
    ({"kataManager": {"config": {"devices": {"exclude": ["10de:1eb8"]}}}},
     ["/kataManager/config", "'devices'"]),
], ids=["resource-without-domain", "resource-missing", "short-ids", "short-bdf", "exclude-not-a-list",
        "unknown-key", "nvswitches-yes", "kata-version", "in-kata-manager-config"])
@pytest.mark.integration
def test_bad_devices_values_are_refused(helm, chart, values, fragments):
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.render(merged(FULL, values), name=RELEASE, namespace=NAMESPACE)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message


# --- an alias may not be a container GPU's name -------------------------------------------

def test_the_charts_container_gpu_names_are_the_programs():
    """_validate.tpl's copy of the container GPU names is gpunode.k8snames' list."""
    import json
    import re

    from support.chartkit import CHART

    from gpunode.k8snames import NVIDIA_CONTAINER_RESOURCES

    text = (CHART / "templates" / "_validate.tpl").read_text()
    body = re.search(r'define "ksm.containerGpuResources" -}}\s*(\[.*?\])\s*{{- end', text, re.S)
    assert body, "ksm.containerGpuResources is not a JSON list in _validate.tpl"
    assert json.loads(body.group(1)) == list(NVIDIA_CONTAINER_RESOURCES)


@pytest.mark.integration
@pytest.mark.parametrize(("values", "named", "taken"), [
    ({"sandboxDevicePlugin": {"alias": "gpu"}}, "sandboxDevicePlugin.alias=gpu", "nvidia.com/gpu"),
    ({"sandboxDevicePlugin": {"env": [{"name": "P_GPU_ALIAS", "value": "GPU"}]}},
     "sandboxDevicePlugin.env P_GPU_ALIAS=GPU", "nvidia.com/gpu"),
    ({"kataSandboxDevicePlugin": {"env": [{"name": "P_GPU_ALIAS", "value": "mig-1g"}]}},
     "kataSandboxDevicePlugin.env P_GPU_ALIAS=mig-1g", "nvidia.com/mig-*"),
    ({"kataSandboxDevicePlugin": {"env": [{"name": "NVSWITCH_ALIAS", "value": "gpu"}]}},
     "kataSandboxDevicePlugin.env NVSWITCH_ALIAS=gpu", "nvidia.com/gpu"),
    # Overridden by the chart's own alias, still refused: it says what the operator meant.
    ({"sandboxDevicePlugin": {"alias": "pgpu", "env": [{"name": "P_GPU_ALIAS", "value": "gpu"}]}},
     "sandboxDevicePlugin.env P_GPU_ALIAS=gpu", "nvidia.com/gpu"),
], ids=["alias", "plugin-env", "kata-plugin-env-mig", "nvswitch-alias", "overridden"])
def test_an_alias_naming_a_container_gpu_is_refused_at_render(helm, chart, values, named, taken):
    """A passthrough GPU published as nvidia.com/gpu would be handed, as /dev/vfio/*, to a runc
    pod: both admission layers admit a container asking for a container GPU's name."""
    with pytest.raises(helm.HelmError) as caught:
        render(chart, merged(FULL, values))
    message = str(caught.value)
    assert named in message and taken in message, message
    assert "set another alias" in message, message
    # Refused with sandbox workloads off too: a later --set sandboxWorkloads.enabled=true
    # must not be what makes it bite.
    with pytest.raises(helm.HelmError):
        render(chart, values)


@pytest.mark.integration
def test_aliases_beside_the_container_names_render(chart):
    rendered = render(chart, merged(FULL, {"sandboxDevicePlugin": {
        "alias": "pgpu", "env": [{"name": "NVSWITCH_ALIAS", "value": "nvswitch"}]}}))
    args = container(rendered, "-sandbox-agent", "sandbox-device-plugin")["args"]
    assert parse_args(args).alias == "pgpu" and parse_args(args).nvswitch_alias == "nvswitch"
