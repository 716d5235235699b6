"""What applies to every test.

Tests that drive a real part (docker-registry, containerd, the Helm engine) are
marked ``integration``. Where the part is missing they skip, except under
REQUIRE_INTEGRATION=1 (as in CI), where such a skip is a failure.

Each area directory has its own conftest.py with that area's fixtures; what tests
share is in tests/support (imported as ``support.<module>``).
"""

from __future__ import annotations

import logging
import os
from importlib.metadata import entry_points

import pytest
from support.paths import REQUIRE_INTEGRATION

from gpunode.services import simulator

# The programs find the simulated node by its entry point (pyproject.toml); an editable
# install made before that entry point existed has none registered, so name the same object
# the way gpunode.services.simulator reads it (the commands' subprocesses inherit it).
if not entry_points(group=simulator.GROUP, name=simulator.NAME):
    os.environ.setdefault(simulator.ENV, "nodesim.launch:SIMULATOR")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_INTEGRATION and report.skipped and item.get_closest_marker("integration"):
        report.outcome = "failed"
        report.longrepr = f"integration test skipped under REQUIRE_INTEGRATION=1: {report.longrepr}"


@pytest.fixture(autouse=True)
def _root_logger_restored():
    """A test that runs a command's main() in-process (which sets up logging) must not
    change what later tests' log captures see."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    root.setLevel(level)
    root.handlers[:] = handlers
