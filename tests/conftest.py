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


_session: list = []  # the session, for its exit status at the very end


def pytest_sessionstart(session) -> None:
    _session.append(session)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """End the run here, with pytest's own exit status, once every report is written, without the
    interpreter's shutdown. Twice a whole run passed every test and then aborted in that shutdown
    (exit 134, nothing printed), with only daemon threads left: Python 3.11 stops such a thread
    where it stands when it next wants the GIL, and one stopped inside a C extension's C++ code
    (grpcio's, the likely one here) aborts the process. The threads left are named, as tests to
    fix."""
    left = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive())
    if left:
        sys.stderr.write(f"threads the tests left running: {', '.join(left)}\n")
    if not _session:
        return
    status = int(_session[0].exitstatus)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
