"""Where the repository is, and what this run requires.

Tests that drive a real part (docker-registry, containerd, the Helm engine) are
marked ``integration``. Where the part is missing they skip, except under
REQUIRE_INTEGRATION=1 (as in CI), where such a skip is a failure (the hook in
tests/conftest.py; ``require_binary`` fails outright).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEST_DATA = REPO / "tests" / "data"
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
