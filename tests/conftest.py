"""Shared test plumbing.

Tests that drive a real part (docker-registry, containerd, the Helm engine) are
marked ``integration``. Where the part is missing they skip, except under
REQUIRE_INTEGRATION=1 (as in CI), where such a skip is a failure.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
HOST_PROFILES = sorted((EXAMPLES / "hosts").glob("*.yaml"))

REQUIRE_INTEGRATION = os.environ.get("REQUIRE_INTEGRATION") == "1"


def require_binary(name: str) -> str:
    """Path of a real tool the test needs; skip (or fail in CI) without it."""
    found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if not found:
        message = f"{name} is not installed (run: bash .ci/setup)"
        if REQUIRE_INTEGRATION:
            pytest.fail(message)
        pytest.skip(message)
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_INTEGRATION and report.skipped and item.get_closest_marker("integration"):
        report.outcome = "failed"
        report.longrepr = f"integration test skipped under REQUIRE_INTEGRATION=1: {report.longrepr}"


@pytest.fixture
def server():
    """The Kubernetes API stand-in (tests/apiserver.py), for the cluster-layer tests."""
    from apiserver import FakeApiServer

    with FakeApiServer() as s:
        yield s


@pytest.fixture
def api(server):
    """The official client pointed at the stand-in."""
    return server.client()
