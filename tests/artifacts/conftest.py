"""Fixtures for the artifact tests: the real docker-registry (tests/support/registry_server.py),
one per test module, plain and with basic auth."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.paths import require_binary
from support.registry_server import (
    REGISTRY_BINARY,
    TEST_PASSWORD,
    TEST_USER,
    RunningRegistry,
    run_registry,
)


def _require_registry() -> None:
    require_binary(REGISTRY_BINARY)


@pytest.fixture(scope="module")
def registry_server(tmp_path_factory) -> Iterator[RunningRegistry]:
    _require_registry()
    with run_registry(tmp_path_factory.mktemp("registry")) as running:
        yield running


@pytest.fixture(scope="module")
def auth_registry_server(tmp_path_factory) -> Iterator[RunningRegistry]:
    _require_registry()
    with run_registry(
        tmp_path_factory.mktemp("auth-registry"), users={TEST_USER: TEST_PASSWORD}
    ) as running:
        yield running
