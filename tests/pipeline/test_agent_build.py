"""``agent.build(settings, api)``: the agent ``katamgr run`` runs, linked to the cluster as its
settings say (Events, the GPU labels, the CC modes), and the agent package free of import
circles (function-level and TYPE_CHECKING imports counted): the loop knows the agent only
as the Protocol it declares."""

from __future__ import annotations

import ast

import pytest
from support.apiserver import FakeApiServer
from support.paths import REPO

from gpunode.errors import ConfigError
from gpunode.host.cc import CcMode
from gpunode.host.pciids import PciIds
from gpunode.policy.gpulabels import KEYS, PRODUCT
from gpunode.policy.naming import Naming
from katamgr.agent.build import build
from katamgr.agent.settings import AgentSettings
from katamgr.pipeline.reconcile import Steps
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

NAMING = Naming(PciIds.find())
NODE = "dgx-1"


def _settings(host, **given) -> AgentSettings:
    return AgentSettings(host, NAMING, Steps(kata=False), None, follow=False, **given)


def _labels(api) -> dict[str, str]:
    return api.get("nodes", NODE)["metadata"].get("labels", {})


def test_with_a_cluster_and_a_node_name_the_agent_labels_the_node_and_records_events(tmp_path):
    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {}}})
        agent = build(_settings(host, node_name=NODE), api.client())
        assert agent.run(once=True) == 0
        assert _labels(api)[PRODUCT] == "NVIDIA-H100-80GB-HBM3"
        assert any(api.get("events", n, "default")["reason"] == "GpuLabelsSet" for n in api.names("events"))


def test_without_gpu_labels_or_without_a_node_name_nothing_is_published(tmp_path):
    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {}}})
        assert build(_settings(host), api.client()).run(once=True) == 0
        assert not set(KEYS) & set(_labels(api)) and api.names("events") == []
        assert build(_settings(host, node_name=NODE, gpu_labels=False), api.client()).run(once=True) == 0
        assert not set(KEYS) & set(_labels(api)) and api.names("events")  # Events, no labels


def test_cc_modes_without_a_cluster_are_refused_in_one_sentence(tmp_path):
    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    with pytest.raises(ConfigError, match=r"^--cc-manager follows the node label nvidia.com/cc.mode: it needs "
                                          r"--node-name \(or NODE_NAME\) and a cluster to ask$"):
        build(_settings(host, node_name=NODE, cc_default_mode=CcMode.ON), None)


def _agent_imports() -> dict[str, set[str]]:
    """Each module of katamgr.agent and the modules of katamgr.agent it imports anywhere in
    its text (module level, functions, TYPE_CHECKING blocks)."""
    graph: dict[str, set[str]] = {}
    for path in sorted((REPO / "katamgr" / "agent").glob("*.py")):
        name = f"katamgr.agent.{path.stem}" if path.stem != "__init__" else "katamgr.agent"
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("katamgr.agent"):
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("katamgr.agent"))
        graph[name] = found
    return {m: {i for i in imported if i in graph and i != m} for m, imported in graph.items()}


def test_the_agent_package_has_no_import_circle():
    graph = _agent_imports()
    graph.pop("katamgr.agent")  # the package's re-exports sit above every module
    circles = []

    def visit(module: str, path: list[str]) -> None:
        for imported in graph.get(module, ()):
            if imported in path:
                circles.append(path[path.index(imported):] + [imported])
            else:
                visit(imported, [*path, imported])

    for module in graph:
        visit(module, [module])
    assert circles == []
    assert "katamgr.agent.running" not in graph["katamgr.agent.loop"]
