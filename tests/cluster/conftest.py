"""Fixtures for the cluster-layer tests: the Kubernetes API stand-in and a client of it."""

from __future__ import annotations

import pytest


@pytest.fixture
def server():
    """The Kubernetes API stand-in (tests/support/apiserver.py), for the cluster-layer tests."""
    from support.apiserver import FakeApiServer

    with FakeApiServer() as s:
        yield s


@pytest.fixture
def api(server):
    """The official client pointed at the stand-in."""
    return server.client()
