"""plan says which workload it plans for and why, and on a container node claims no binds."""

from __future__ import annotations

import pytest
from support.hostkit import GPU_A10, dev, make_host

from gpunode.host.pciids import PciIds
from gpunode.policy.naming import Naming
from katamgr.pipeline.reconcile import Steps, full_plan, reconcile
from katamgr.render import plan_text

NAMING = Naming(PciIds.find())


def node(tmp_path):
    return make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4), dev("0000:02:00.0", GPU_A10, "nvidia", 5)])


def test_a_container_node_plans_no_binds_and_says_why(tmp_path):
    host = node(tmp_path)
    plan = full_plan(host, NAMING, Steps(workload="container"), None, workload_why="node n1 is labeled container")
    data = plan.to_json()
    assert data["workload"] == {"mode": "container", "why": "node n1 is labeled container"}
    assert {d["action"] for d in data["devices"]} == {"skip"}
    assert data["resources"] == {}
    text = plan_text(plan)
    assert "Workload: container (node n1 is labeled container)" in text
    assert "Schedulable after apply: nothing." in text and " bind " not in text


def test_gpus_left_on_vfio_by_an_earlier_mode_are_named_with_the_way_back(tmp_path):
    host = node(tmp_path)
    assert reconcile(host, NAMING, Steps(), None).ok  # the node ran vm-passthrough
    plan = full_plan(host, NAMING, Steps(workload="container"), None).to_json()
    assert [(d["bdf"], d["action"]) for d in plan["devices"]] == [("0000:01:00.0", "keep"), ("0000:02:00.0", "keep")]
    assert all("katamgr revert" in d["reason"] for d in plan["devices"])
    assert any("0000:01:00.0, 0000:02:00.0 stay on vfio-pci" in p and "katamgr revert" in p
               for p in plan["problems"])


def test_a_passthrough_plan_names_its_workload(tmp_path):
    plan = full_plan(node(tmp_path), NAMING, Steps(), None, workload_why="chosen with --workload")
    assert plan.to_json()["workload"] == {"mode": "vm-passthrough", "why": "chosen with --workload"}
    assert plan.resources == {"nvidia.com/GA102GL_A10": 2}


# ---- the NVIDIA Container Toolkit's envvar setting on a container node -------------------

TOOLKIT = "/etc/nvidia-container-runtime/config.toml"
KEY = "accept-nvidia-visible-devices-envvar-when-unprivileged"


def container_plan(tmp_path, config: str | None):
    host = node(tmp_path)
    if config is not None:
        path = host.path(TOOLKIT)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(config)
    return full_plan(host, NAMING, Steps(workload="container"), None)


def toolkit_problems(plan):
    return [p for p in plan.problems if KEY in p]


@pytest.mark.parametrize(("config", "now"), [
    (f"{KEY} = true\n[nvidia-container-cli]\nldconfig = \"@/sbin/ldconfig\"\n", "is true"),
    ("disable-require = false\n[nvidia-container-runtime]\nmode = \"auto\"\n", "is not set"),
])
def test_a_container_node_where_pods_may_pick_gpus_gets_a_problem_naming_file_and_key(tmp_path, config, now):
    plan = container_plan(tmp_path, config)
    [problem] = toolkit_problems(plan)
    assert problem.startswith(f"{TOOLKIT}: {KEY} {now}")
    assert "set it to false" in problem and "NVIDIA_VISIBLE_DEVICES" in problem
    assert "--device-list-strategy volume-mounts" in problem  # what keeps GPU pods working then
    assert plan.to_json()["toolkit"]["read"] is True
    assert "Problems:" in plan_text(plan) and "NVIDIA Container Toolkit:" in plan_text(plan)


def test_a_toolkit_that_ignores_the_variable_is_no_problem(tmp_path):
    plan = container_plan(tmp_path, f"{KEY} = false\naccept-nvidia-visible-devices-as-volume-mounts = true\n")
    assert toolkit_problems(plan) == []
    toolkit = plan.to_json()["toolkit"]
    assert toolkit[KEY] is False and toolkit["accept-nvidia-visible-devices-as-volume-mounts"] is True
    assert toolkit["notes"] == []


def test_a_value_that_is_not_a_boolean_is_noted_and_still_a_problem(tmp_path):
    plan = container_plan(tmp_path, f'{KEY} = "false"\n')
    assert len(toolkit_problems(plan)) == 1
    assert "not a boolean" in plan.to_json()["toolkit"]["notes"][0]


@pytest.mark.parametrize(("config", "said"), [
    (f"{KEY} = fals\n", "is not valid TOML"),
    (None, "does not exist"),
])
def test_an_unreadable_or_missing_toolkit_config_is_a_note_not_a_crash(tmp_path, config, said):
    plan = container_plan(tmp_path, config)
    assert toolkit_problems(plan) == []
    toolkit = plan.to_json()["toolkit"]
    assert toolkit["read"] is False and len(toolkit["notes"]) == 1
    assert toolkit["notes"][0].startswith(f"{TOOLKIT} {said}")
    assert f"note: {TOOLKIT} {said}" in plan_text(plan)


def test_a_directory_in_place_of_the_config_is_a_note(tmp_path):
    host = node(tmp_path)
    host.path(TOOLKIT).mkdir(parents=True)
    plan = full_plan(host, NAMING, Steps(workload="container"), None)
    assert "not a regular file" in plan.to_json()["toolkit"]["notes"][0]


def test_only_a_container_node_reads_the_toolkit_config(tmp_path):
    for steps in (Steps(), Steps(workload="vm-vgpu")):
        assert "toolkit" not in full_plan(node(tmp_path / steps.workload.value), NAMING, steps, None).to_json()
