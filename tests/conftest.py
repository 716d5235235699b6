"""What applies to every test.

Tests that drive a real part (docker-registry, containerd, the Helm engine) are
marked ``integration``. Where the part is missing they skip, except under
REQUIRE_INTEGRATION=1 (as in CI), where such a skip is a failure.

Each area directory has its own conftest.py with that area's fixtures; what tests
share is in tests/support (imported as ``support.<module>``).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
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


def pytest_unconfigure(config) -> None:
    """Nothing a test left running may act during the interpreter's shutdown. A gRPC (grpcio)
    server or channel still open has a daemon thread in C++ code, which aborts the process (exit
    134, "FATAL: exception not rethrown") when finalization stops it; a daemon thread that logs
    then can die holding stderr's lock, which aborts it too. So name the threads left (a test to
    fix), close every gRPC server and channel, and silence logging."""
    import grpc

    left = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive())
    if left:
        sys.stderr.write(f"threads the tests left running: {', '.join(left)}\n")
    for thing in gc.get_objects():
        try:
            if isinstance(thing, grpc.Server):
                thing.stop(None).wait(5)
            elif isinstance(thing, grpc.Channel):
                thing.close()
        except Exception:  # already closed, or half made: nothing to stop
            pass
    logging.disable(logging.CRITICAL)
