"""The control-plane suite: one real Kubernetes control plane per test session.

The session fixture ``kube`` runs ``hack/local-cluster up`` (etcd, kube-apiserver,
kube-controller-manager and kube-scheduler of the version pinned in hack/kube/go.mod,
built once into the user's cache dir by hack/kube/build; .ci/run builds them before the
tests so the build time is printed apart) and ``hack/local-cluster down`` at the end.
Every test here talks to that real API server: the chart applied server-side, the
ServiceAccounts' RBAC exercised with tokens the API server issues, Pods admitted through
our webhook and policy, the agent and the device plugin following a Node.

Under REQUIRE_INTEGRATION=1 (CI) a control plane that cannot be built or started fails
the suite, never skips it. ``pytest tests/controlplane`` runs it alone; its time is
printed in the terminal summary ("control-plane suite: ...").
"""

from __future__ import annotations

import pytest
from support.kubecluster import LocalCluster, missing_part
from support.paths import REQUIRE_INTEGRATION

_timing: dict[str, float] = {"tests": 0.0}


def pytest_collection_modifyitems(items):
    for item in items:
        if "controlplane" in item.nodeid.split("/"):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def kube(tmp_path_factory):
    why = missing_part()
    if why:
        if REQUIRE_INTEGRATION:
            pytest.fail(why)
        pytest.skip(why)
    cluster = LocalCluster.up(tmp_path_factory.mktemp("local-cluster"))
    _timing["start"] = cluster.start_seconds
    try:
        yield cluster
    finally:
        cluster.down()


def pytest_runtest_logreport(report) -> None:
    # Called for this directory's tests only: their setup, call and teardown add up to
    # the suite's own time (the cluster's start is in the first test's setup).
    if "controlplane/" in report.nodeid:
        _timing["tests"] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if "start" in _timing:
        terminalreporter.write_line(
            f"control-plane suite: {_timing['tests']:.0f} s "
            f"(hack/local-cluster up {_timing['start']:.1f} s)")
