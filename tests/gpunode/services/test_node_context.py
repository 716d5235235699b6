"""The three node programs resolve one node alike (``gpunode.services.nodecontext``): each
command line the chart renders (katamgr run in the agent, sandbox-device-plugin, or
sandbox-dra-driver in its place) builds the node's context on one simulated node, and they
agree on the Kata release, the NVLink fabric model, whether the NVSwitches stay with Fabric
Manager, the names and the link policy. The chart is rendered by the real Helm engine
(``support.chartkit``); the node is a simulated DGX H100 with kata-deploy's Kata 4.1.0 and
its Fabric Manager answering in the Shared NVSwitch mode (Fabric Manager User Guide §7)."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile

import pytest
from support.chartkit import CHART, FULL, load_helm, merged, pod_containers, render, workloads

from gpunode.policy.inventory import discover
from gpunode.policy.katarelease import KataRelease
from gpunode.services import nvlinkfabric as nf
from katamgr.cli import build_parser as katamgr_parser
from katamgr.commands import setup as katamgr_setup
from nodesim.katadeploy import KataInstall
from nodesim.materialise import materialise
from nodesim.profiles import find_profile
from sandbox_plugin import commands as plugin_commands
from sandbox_plugin.cli import build_parser as plugin_parser
from sandbox_plugin.dra.cli import build_parser as dra_parser

PARSERS = {"katamgr": katamgr_parser, "sandbox-device-plugin": plugin_parser, "sandbox-dra-driver": dra_parser}
VALUES = merged(FULL, {"devices": {"linkPolicy": "warn"}, "sandboxDevicePlugin": {"alias": "pgpu"}})


@pytest.fixture(scope="module")
def chart():
    helm = load_helm()
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture
def node_root():
    """A simulated DGX H100 in a short temp dir (its FM's unix socket lives under it)."""
    directory = tempfile.mkdtemp(prefix="nc-")
    profile = dataclasses.replace(find_profile("dgx-h100"), kata=KataInstall("kata-deploy", "4.1.0", ("go",)))
    host = materialise(profile, directory)
    yield host.root
    shutil.rmtree(directory, ignore_errors=True)


def command_lines(chart, values) -> dict[str, tuple[str, list[str], str | None]]:
    """container -> (program, args, the agent's config file text) as the chart renders them."""
    rendered = render(chart, values)
    config = rendered.get("ConfigMap", "-config")["data"]["config.yaml"]
    out = {}
    for workload in workloads(rendered):
        for c in pod_containers(workload):
            program, *sub = c.get("command") or [""]
            if program in PARSERS:
                out[c["name"]] = (program, [str(a) for a in (*sub, *(c.get("args") or []))], config)
    return out


def on_node(args: list[str], root, config_file) -> list[str]:
    """The pod's command line pointed at the simulated node: its / mounted at --host-root, the
    ConfigMap's file where the pod mounts it."""
    out = list(args)
    out[out.index("--host-root") + 1] = str(root)
    if "--config" in out:
        out[out.index("--config") + 1] = str(config_file)
    return out


def context_of(program: str, args: list[str]):
    parsed = PARSERS[program]().parse_args(args)
    if program == "katamgr":
        config = katamgr_setup.config_from(parsed)
        with katamgr_setup.node_context(parsed, config) as node:
            return node
    return plugin_commands.node_context(parsed)


@pytest.mark.integration
def test_every_rendered_program_resolves_the_node_alike(chart, node_root, tmp_path):
    lines = {**command_lines(chart, VALUES), **command_lines(chart, merged(VALUES, {"dra": {"enabled": True}}))}
    assert {"kata-manager", "sandbox-device-plugin", "dra-driver"} <= set(lines)
    config_file = tmp_path / "config.yaml"
    contexts = {}
    for container in ("kata-manager", "sandbox-device-plugin", "dra-driver"):
        program, args, config = lines[container]
        config_file.write_text(config)
        contexts[container] = context_of(program, on_node(args, node_root, config_file))

    def resolved(node) -> dict:
        passthrough = discover(node.host, node.naming.selection, node.naming.nvswitch_rule).passthrough
        return {
            "kata": node.kata, "fabric model": node.fabric_model, "keeps NVSwitches": node.keeps_nvswitches,
            "passthrough": {d.bdf: node.naming.resource(d) for d in passthrough},
            "workload rule": (node.workload.node_name, node.workload.default),
            "link policy": node.link_policy,
        }

    agent = resolved(contexts["kata-manager"])
    for container in ("sandbox-device-plugin", "dra-driver"):
        assert resolved(contexts[container]) == agent, container
    # What they agree on is this node's: the release kata-deploy installed, FM's model keeping
    # the NVSwitches on the host (so only the 8 GPUs pass), the chart's names and link policy.
    assert agent["kata"] == KataRelease((4, 1, 0))
    assert agent["fabric model"] == nf.SHARED and agent["keeps NVSwitches"]
    assert len(agent["passthrough"]) == 8
    assert set(agent["passthrough"].values()) == {"nvidia.com/pgpu"} and agent["link policy"] == "warn"


def test_the_link_policy_flag_overrides_the_config_and_degrade_is_the_default(node_root, tmp_path):
    config_file = tmp_path / "config.yaml"
    config_file.write_text("devices:\n  linkPolicy: warn\n")
    base = ["run", "--host-root", str(node_root), "--config", str(config_file)]
    assert context_of("katamgr", base).link_policy == "warn"
    assert context_of("katamgr", [*base, "--link-policy", "degrade"]).link_policy == "degrade"
    assert context_of("sandbox-device-plugin", ["--host-root", str(node_root)]).link_policy == "degrade"
