"""The pods the kubelet refused, looked for while the offer gate stays open (``agent.rejected``).

The kubelet writes a refusal to the API server through its status manager (k8s.io/kubernetes
v1.35.4, pkg/kubelet/status/status_manager.go), which may lag the admission: on the real node
after a reboot (tests/node/test_node_restarts.py), a pod refused before the plugin registered was
not yet Failed in the API when the gate opened. Here the lag is played by a list that shows the
pod only later."""

from __future__ import annotations

from support.passthroughkit import A10

from katamgr.agent.events import NodeEvents
from katamgr.agent.rejected import AGAIN, WINDOW, RejectedPods
from katamgr.cluster.pods import FailedPod


def _refused(name: str) -> FailedPod:
    return FailedPod("tenant", name, f"uid-{name}", "UnexpectedAdmissionError",
                     f"Allocate failed due to no healthy devices present; cannot allocate unhealthy devices {A10}",
                     (A10,), None)


def test_a_refusal_the_api_server_learns_after_the_gate_opened_is_named_once_and_nothing_is_listed_at_rest():
    now = [100.0]
    listed: list[list[FailedPod]] = [[]]
    lists = []

    def failed() -> list[FailedPod]:
        lists.append(now[0])
        return listed[0]

    rejected = RejectedPods(failed, lambda: {A10}, NodeEvents(), clock=lambda: now[0])
    assert rejected.opened() == []  # the kubelet's status not in the API yet
    listed[0] = [_refused("holder")]
    now[0] += AGAIN / 2
    assert rejected.still_open() == [] and len(lists) == 1  # not listed again so soon
    now[0] += AGAIN
    [line] = rejected.still_open()
    assert line.startswith("tenant/holder (asked for ") and "a bare pod stays Failed" in line
    now[0] += AGAIN
    assert rejected.still_open() == []  # named once
    now[0] += WINDOW
    count = len(lists)
    assert rejected.still_open() == [] and len(lists) == count  # at rest: no list
    listed[0] = [_refused("holder"), _refused("late")]
    assert [x.split(" ")[0] for x in rejected.opened()] == ["tenant/late"]  # the next opening
