"""The chart's upgrade goes node by node through the DaemonSets' own rolling update, gated on
the new agent's readiness.

Kubernetes' DaemonSet controller (pkg/controller/daemon/update.go, rollingUpdate) deletes at
most ``maxUnavailable`` old pods at a time (with ``maxSurge`` 0, the default) and counts a new
pod available only once it has been Ready for ``minReadySeconds``; while a new pod is not
available, no further old pod is replaced. So the agent's readinessProbe (``/readyz``: the
reconcile succeeded and the node's Kata artifacts verified, tests/pipeline/test_upgrade_gate.py)
is what stops a bad artifact on the first node. The container device plugin's DaemonSet surges
instead (``maxSurge``, ``maxUnavailable`` 0): its new pod registers with the kubelet before the
old one stops (tests/plugin/test_plugin_takeover.py), so nvidia.com/gpu never lacks a plugin for
long. It has no ``minReadySeconds``: the controller's status counts only each node's oldest pod
(daemon_controller.go ``updateDaemonSetStatus``), so it would not look again by itself once a surged pod
had been Ready that long, and the old pod would stay (seen on the local cluster: past 180 s).
"""

from __future__ import annotations

import pytest
from support.chartkit import FULL, NAMESPACE, RELEASE, merged, render


def agent_daemonset(rendered):
    return rendered.get("DaemonSet", "-sandbox-agent")


def container(ds, name):
    return next(c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == name)


@pytest.mark.integration
def test_the_default_rollout_is_one_node_at_a_time_gated_on_the_verified_agent(chart):
    rendered = render(chart, FULL)
    for ds in rendered.daemonsets():
        surge = ds["metadata"]["name"].endswith("-device-plugin")
        assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": (
            {"maxSurge": 1, "maxUnavailable": 0} if surge else {"maxUnavailable": 1})}, ds["metadata"]["name"]
        assert ds["spec"]["minReadySeconds"] == (0 if surge else 30)
    assert any(ds["metadata"]["name"].endswith("-device-plugin") for ds in rendered.daemonsets())
    agent = container(agent_daemonset(rendered), "kata-manager")
    probe = agent["readinessProbe"]
    assert probe["httpGet"] == {"path": "/readyz", "port": "metrics-agent"}
    # Three failures (30 s) mark a pod unready; the rollout needs 30 s of Ready after that.
    assert probe["periodSeconds"] * probe["failureThreshold"] <= 30
    # Liveness asks only whether the loop ticks: an unverified node is not restarted in a loop,
    # it stays up and unready, saying why on /readyz.
    assert agent["livenessProbe"]["httpGet"]["path"] == "/healthz"


@pytest.mark.integration
def test_the_rollout_pace_comes_from_the_values(chart):
    rendered = render(chart, merged(FULL, {"daemonsets": {"rollingUpdate": {"maxUnavailable": "10%"},
                                                          "minReadySeconds": 120}}))
    for ds in rendered.daemonsets():
        surge = ds["metadata"]["name"].endswith("-device-plugin")
        assert ds["spec"]["updateStrategy"]["rollingUpdate"] == (
            {"maxSurge": "10%", "maxUnavailable": 0} if surge else {"maxUnavailable": "10%"})
        assert ds["spec"]["minReadySeconds"] == (0 if surge else 120)


@pytest.mark.parametrize(("values", "fragments"), [
    ({"daemonsets": {"rollingUpdate": {"maxUnavailable": "0"}}}, ["/daemonsets/rollingUpdate/maxUnavailable"]),
    ({"daemonsets": {"rollingUpdate": {"maxUnavailable": 0}}}, ["/daemonsets/rollingUpdate/maxUnavailable"]),
    ({"daemonsets": {"rollingUpdate": {"maxUnavailable": "one"}}}, ["/daemonsets/rollingUpdate/maxUnavailable"]),
    ({"daemonsets": {"minReadySeconds": -1}}, ["/daemonsets/minReadySeconds"]),
    ({"daemonsets": {"minReadySeconds": "30s"}}, ["/daemonsets/minReadySeconds", "integer"]),
], ids=["zero-string", "zero", "word", "negative", "duration"])
def test_a_rollout_that_could_never_move_or_a_bad_pace_is_refused(helm, chart, values, fragments):
    # maxUnavailable 0 with maxSurge 0 is refused by the API server's DaemonSet validation
    # (pkg/apis/apps/validation: "may not be 0 when `maxSurge` is 0"): the chart refuses it first.
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    for fragment in fragments:
        assert fragment in str(caught.value), str(caught.value)
