"""Every command line the chart renders is one its program takes: katamgr (the agent, the
uninstall revert, the webhook), sandbox-device-plugin (the passthrough and the container
plugin) and sandbox-dra-driver, parsed by the programs' own parsers and the shared options'
checks (gpunode.services.options). The chart passes the values as values.yaml writes them, so a
value the options did not take would only show on a node, as a pod in CrashLoopBackOff."""

from __future__ import annotations

import pytest
from chartvalues import VALUE_SETS
from support.chartkit import FULL, merged, pod_containers, render, workloads

from gpunode.services import options
from katamgr.cli import build_parser as katamgr_parser
from sandbox_plugin.cli import build_parser as plugin_parser
from sandbox_plugin.dra.cli import build_parser as dra_parser

PARSERS = {"katamgr": katamgr_parser, "sandbox-device-plugin": plugin_parser,
           "sandbox-dra-driver": dra_parser}

# Value sets whose flags differ from the defaults' (the shared VALUE_SETS are added to these).
FLAG_SETS = {
    **VALUE_SETS,
    "dra": merged(FULL, {"dra": {"enabled": True}}),
    "plan-only": merged(FULL, {"kataManager": {"planOnly": True}}),
    "cc-manager": merged(FULL, {"ccManager": {"enabled": True, "defaultMode": "devtools"}}),
    "metrics-json": merged(FULL, {"metrics": {"enabled": True}, "logFormat": "json"}),
    "devices": merged(FULL, {"devices": {
        "include": [{"ids": "1234:11e8", "resource": "example.com/edu"}],
        "exclude": ["0000:01:00.0", "10de:1eb8"], "nvswitches": False, "kataVersion": "4.1.0",
        "nvlinkFabric": "sharedNvswitch", "fabricManager": {
            "address": "/run/nvidia-fabricmanager/fm.sock", "library": "/usr/lib/libnvfm.so.1",
            "gpuModuleIds": "1=0000:1b:00.0"}, "linkPolicy": "warn"},
        "sandboxDevicePlugin": {"alias": "pgpu", "resourceNaming": "compact"},
        "hostPaths": {"rootFS": "/srv/node/"}}),
    "devices-dra": merged(FULL, {"dra": {"enabled": True}, "devices": {"nvswitches": True}}),
}

# What every program that names or selects devices must read alike from its flags.
SHARED = ("runtime_root", "node_name", "default_workload", "resource_naming", "alias", "nvswitch_alias",
          "include_device", "exclude_device", "nvswitches", "kata_version", "nvlink_fabric",
          "fabric_manager_address", "fabric_manager_library", "gpu_module_ids", "link_policy", "log_format")


def program_lines(rendered) -> list[tuple[str, str, list[str]]]:
    """(container, program, args) of every container running one of the three programs."""
    out = []
    for workload in workloads(rendered):
        for c in pod_containers(workload):
            program, *subcommand = c.get("command") or [""]
            if program in PARSERS:
                out.append((c["name"], program, [str(a) for a in (*subcommand, *(c.get("args") or []))]))
    return out


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(FLAG_SETS))
def test_every_rendered_command_line_is_taken_by_its_program(chart, name, capsys):
    lines = program_lines(render(chart, FLAG_SETS[name]))
    assert lines or name == "defaults" or "nothing" in name
    parsed = {}
    for container, program, args in lines:
        try:
            ns = PARSERS[program]().parse_args(args)
        except SystemExit:
            pytest.fail(f"{container}: {program} {' '.join(args)}: {capsys.readouterr().err}")
        assert "deprecated" not in capsys.readouterr().err, container  # the chart writes today's spellings
        if hasattr(ns, "include_device"):  # it selects devices: the shared checks take the values too
            selection = options.selection_from(ns)
            options.naming_from(ns, selection)
            options.fabric_from(ns)
            parsed[container] = ns
    # The agent and the plugin beside it (or the DRA driver) read every shared setting alike.
    served = [parsed[c] for c in ("sandbox-device-plugin", "dra-driver") if c in parsed]
    if "kata-manager" in parsed and served:
        for option in SHARED:
            assert {str(getattr(ns, option)) for ns in (parsed["kata-manager"], *served)} \
                == {str(getattr(parsed["kata-manager"], option))}, option


@pytest.mark.integration
def test_the_values_reach_the_programs_in_their_own_spelling(chart):
    rendered = render(chart, FLAG_SETS["devices"])
    for container, program, args in program_lines(rendered):
        if container not in ("kata-manager", "sandbox-device-plugin"):
            continue
        ns = PARSERS[program]().parse_args(args)
        selection = options.selection_from(ns)
        assert selection.nvswitches is False and str(options.kata_release_from(ns)) == "Kata 4.1.0"
        assert [str(r) for r in selection.include] == ["1234:11e8=example.com/edu"]
        assert ns.runtime_root == "/srv/node"  # hostPaths.rootFS as written, normalised
        fabric = options.fabric_from(ns)
        assert (fabric.model, fabric.address, fabric.module_ids) == (
            "sharedNvswitch", "/run/nvidia-fabricmanager/fm.sock", {1: "0000:1b:00.0"})
        assert options.naming_from(ns, selection).gpu_alias == "pgpu"
        assert ns.link_policy == "warn"  # devices.linkPolicy: the plugin and the hand-back check judge alike
