"""katamgr, sandbox-device-plugin and sandbox-dra-driver take their shared settings with one
spelling, one default and one check (gpunode.services.options): an operator who learned one
program's flags, or copied them from one container of the chart to another, gets the same
meaning, the same default and the same refusal from the other two."""

from __future__ import annotations

import pytest

from katamgr.cli import build_parser as katamgr_parser
from katamgr.cli import main as katamgr_main
from sandbox_plugin.cli import build_parser as plugin_parser
from sandbox_plugin.cli import main as plugin_main
from sandbox_plugin.dra.cli import build_parser as dra_parser
from sandbox_plugin.dra.cli import main as dra_main

# Each program's command line up to its options: katamgr's node agent is `katamgr run`.
PROGRAMS = {
    "katamgr": (katamgr_parser, ["run"]),
    "sandbox-device-plugin": (plugin_parser, []),
    "sandbox-dra-driver": (dra_parser, []),
}

SHARED = ("host_root", "runtime_root", "kubelet_dir", "node_name", "workload", "default_workload", "pci_ids",
          "resource_naming", "alias", "nvswitch_alias", "include_device", "exclude_device",
          "nvswitches", "kata_version", "nvlink_fabric", "fabric_manager_address",
          "fabric_manager_library", "gpu_module_ids", "log_format", "verbose")


def parse(program: str, *args: str):
    build, before = PROGRAMS[program]
    return build().parse_args([*before, *args])


def test_the_three_programs_have_the_same_defaults(monkeypatch):
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")  # the downward API's, in the chart's pods
    defaults = {program: parse(program) for program in PROGRAMS}
    for option in SHARED:
        seen = {program: getattr(ns, option) for program, ns in defaults.items()}
        assert len({repr(v) for v in seen.values()}) == 1, (option, seen)
    katamgr = defaults["katamgr"]
    # A node without the workload label runs container, as the GPU Operator's nodes do.
    assert (katamgr.workload, katamgr.default_workload, katamgr.node_name) == ("auto", "container", "gpu-node-7")


@pytest.mark.parametrize("args", [
    ("--workload", "vm-passthrough", "--default-workload", "vm-passthrough"),
    ("--nvswitches", "true", "--kata-version", "4.1.0"),
    ("--nvswitches", "false"),
    ("--runtime-root", "/srv/node/"),
    ("--kubelet-dir", "/var/lib/k0s/kubelet/"),
    ("--include-device", "1234:11e8=example.com/edu", "--exclude-device", "0000:01:00.0"),
    ("--resource-naming", "compact", "--alias", "pgpu"),
    ("--nvlink-fabric", "sharedNvswitch", "--gpu-module-ids", "1=0000:1b:00.0"),
    ("--log-format", "json", "--node-name", "n1"),
])
def test_one_spelling_means_the_same_in_all_three(args):
    parsed = {program: parse(program, *args) for program in PROGRAMS}
    for option in SHARED:
        assert len({repr(getattr(ns, option)) for ns in parsed.values()}) == 1, option


@pytest.mark.parametrize(("args", "named"), [
    (("--workload", "gpu-please"), "'gpu-please'"),
    (("--default-workload", "auto"), "'auto'"),  # auto is what --workload resolves, not a workload
    (("--runtime-root", "srv/node"), "'srv/node' is not an absolute path"),
    (("--kubelet-dir", "var/lib/k0s/kubelet"), "'var/lib/k0s/kubelet' is not an absolute path"),
    (("--nvswitches", "maybe"), "'maybe' is not one of auto, true, false"),
    (("--nvlink-fabric", "nvlink"), "'nvlink'"),
    (("--resource-naming", "short"), "'short'"),
    (("--log-format", "xml"), "'xml'"),
])
def test_a_bad_value_is_refused_alike_exit_2_naming_it(capsys, args, named):
    for program in PROGRAMS:
        with pytest.raises(SystemExit) as refused:
            parse(program, *args)
        assert refused.value.code == 2, program
        err = capsys.readouterr().err
        assert args[0] in err and named in err, (program, err)


def test_a_bad_value_found_at_run_time_is_refused_alike(capsys, tmp_path):
    """What argparse cannot see (a --host-root that is not a directory, a bad alias) is
    refused by the same check before anything runs: exit 2, the same sentence."""
    missing = str(tmp_path / "no-such-root")
    runs = {"katamgr": lambda a: katamgr_main(["plan", *a]), "sandbox-device-plugin": plugin_main,
            "sandbox-dra-driver": lambda a: dra_main(["--node-name", "n1", *a])}
    for bad, sentence in ((["--host-root", missing], f"--host-root '{missing}' is not a directory"),
                          (["--host-root", str(tmp_path), "--alias", "p gpu"], "--alias: alias 'p gpu'")):
        for program, run in runs.items():
            assert run(bad) == 2, program
            assert sentence in capsys.readouterr().err, program


def test_the_older_spellings_still_work_and_say_what_to_write(capsys):
    """Manifests and scripts written before one spelling per setting keep working."""
    assert parse("sandbox-device-plugin", "--mode", "vm-passthrough").workload == "vm-passthrough"
    assert "--mode is deprecated; use --workload" in capsys.readouterr().err
    for program in PROGRAMS:
        assert parse(program, "--nvswitches", "yes").nvswitches is True
        assert "write --nvswitches true" in capsys.readouterr().err


def test_katamgr_works_on_the_host_with_the_kubelet_dir_it_is_given(tmp_path):
    """The node's kubelet root (k0s: /var/lib/k0s/kubelet) is where katamgr asks the
    kubelet's PodResources service which pods hold GPUs (gpunode.services.podresources)."""
    from katamgr.commands.setup import host_from

    args = parse("katamgr", "--host-root", str(tmp_path), "--kubelet-dir", "/var/lib/k0s/kubelet/")
    with host_from(args) as (host, _):
        assert host.kubelet_dir == "/var/lib/k0s/kubelet"
    with host_from(parse("katamgr", "--host-root", str(tmp_path))) as (host, _):
        assert host.kubelet_dir == "/var/lib/kubelet"
