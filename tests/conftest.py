"""What applies to every test.

Tests that drive a real part (docker-registry, containerd, the Helm engine) are
marked ``integration``. Where the part is missing they skip, except under
REQUIRE_INTEGRATION=1 (as in CI), where such a skip is a failure.

Each area directory has its own conftest.py with that area's fixtures; what tests
share is in tests/support (imported as ``support.<module>``).
"""

from __future__ import annotations

import pytest
from support.paths import REQUIRE_INTEGRATION


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_INTEGRATION and report.skipped and item.get_closest_marker("integration"):
        report.outcome = "failed"
        report.longrepr = f"integration test skipped under REQUIRE_INTEGRATION=1: {report.longrepr}"
