"""kataManager.planOnly: a look at every GPU node before the chart changes any. The agent
runs `katamgr run --plan-only` (tests/cli/test_plan_only.py shows that it writes nothing,
even on a read-only root) with the node's root filesystem as its one host mount, read-only;
nothing else of the sandbox agent runs and no RuntimeClass is offered."""

from __future__ import annotations

import pytest
from support.chartkit import FULL, cluster_at, container, container_names, merged, notes, render

pytestmark = pytest.mark.integration

PLAN_ONLY = merged(FULL, {"kataManager": {"planOnly": True}})


def test_the_agent_only_plans(chart):
    rendered = render(chart, PLAN_ONLY)
    agent = container(rendered, "-sandbox-agent", "kata-manager")
    assert agent["args"][0] == "run" and "--plan-only" in agent["args"]
    # Nothing else runs beside it: the device plugin would register with the kubelet.
    assert container_names(rendered, "-sandbox-agent") == ["kata-manager"]


def test_the_host_is_mounted_read_only_and_nothing_is_created_on_it(chart):
    rendered = render(chart, PLAN_ONLY)
    pod = rendered.get("DaemonSet", "-sandbox-agent")["spec"]["template"]["spec"]
    mounts = container(rendered, "-sandbox-agent", "kata-manager")["volumeMounts"]
    assert all(m["readOnly"] for m in mounts), mounts
    assert {m["mountPath"] for m in mounts} == {"/host", "/etc/kata-sandbox-manager"}
    host_paths = [v["hostPath"] for v in pod["volumes"] if "hostPath" in v]
    # DirectoryOrCreate would have the kubelet make a directory on the node.
    assert host_paths == [{"path": "/", "type": "Directory"}]
    assert not pod.get("hostPID")  # no containerd to signal


def test_no_runtime_class_is_offered(chart):
    assert not [o for o in render(chart, PLAN_ONLY).objects if o["kind"] == "RuntimeClass"]
    assert [o for o in render(chart, FULL).objects if o["kind"] == "RuntimeClass"]


def test_cc_manager_is_not_carried_out(chart):
    values = merged(PLAN_ONLY, {"ccManager": {"enabled": True}})
    args = container(render(chart, values), "-sandbox-agent", "kata-manager")["args"]
    assert "--plan-only" in args and "--cc-manager" not in args


def test_the_notes_say_how_to_read_the_plans(chart):
    text = notes(chart, PLAN_ONLY)
    assert "PLAN ONLY (kataManager.planOnly=true)" in text
    assert "-c kata-manager" in text
    assert "Runtime classes (created by Helm" not in text
    assert "PLAN ONLY" not in notes(chart, FULL)


def test_off_by_default(chart):
    rendered = render(chart, FULL)
    assert "--plan-only" not in container(rendered, "-sandbox-agent", "kata-manager")["args"]
    assert "sandbox-device-plugin" in container_names(rendered, "-sandbox-agent")


def test_the_plan_only_agent_is_a_valid_daemonset(chart, kube_validate):
    for version in ("1.25.0", "1.35.0"):
        for obj in render(chart, PLAN_ONLY, cluster_at(version)).objects:
            if obj["kind"] == "DaemonSet":
                kube_validate.validate(obj, version, strict=True)
