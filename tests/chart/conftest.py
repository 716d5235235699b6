"""Fixtures for the chart tests: the real Helm engine, the chart loaded into it (one per
test module), and the Kubernetes API schemas of kubernetes-validate. Without them the tests
skip, or fail under REQUIRE_INTEGRATION=1."""

from __future__ import annotations

import pytest
from support.chartkit import CHART, load_helm, part_missing


@pytest.fixture(scope="module")
def helm():
    return load_helm()


@pytest.fixture(scope="module")
def kube_validate():
    try:
        import kubernetes_validate
    except ImportError as exc:
        part_missing(f"kubernetes-validate is not installed ({exc}); run: pip install kubernetes-validate")
    return kubernetes_validate


@pytest.fixture(scope="module")
def chart(helm):
    with helm.Chart.load(CHART) as loaded:
        yield loaded
