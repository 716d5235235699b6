"""plan says which workload it plans for and why, and on a container node claims no binds."""

from __future__ import annotations

from support.hostkit import GPU_A10, dev, make_host

from katamgr.host.naming import Naming
from katamgr.host.pciids import PciIds
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
