"""The GPU labels on the Node: published by the agent (one patch, only when something differs),
left to GFD/NFD where they set them otherwise, removed exactly on revert; shown by plan."""

from __future__ import annotations

import json

from support.agentkit import make_agent
from support.apiserver import FakeApiServer

from gpunode.host.pciids import PciIds
from gpunode.policy import gpulabels as facts
from gpunode.policy.gpulabels import CC_CAPABLE, COUNT, FAMILY, KEYS, MEMORY, PRODUCT
from gpunode.policy.inventory import discover
from gpunode.policy.naming import Naming
from gpunode.policy.workload import WORKLOAD_LABEL
from katamgr import cli
from katamgr.cluster import EventRecorder
from katamgr.commands import setup as cli_setup
from katamgr.pipeline import gpulabels
from katamgr.pipeline.reconcile import Steps, revert_all
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

NAMING = Naming(PciIds.find())
NODE = "dgx-1"
DGX = {PRODUCT: "NVIDIA-H100-80GB-HBM3", FAMILY: "hopper", COUNT: "8", MEMORY: "81559", CC_CAPABLE: "true"}


def _node(api, labels):
    api.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": dict(labels)}})


def _labels(api) -> dict[str, str]:
    return api.get("nodes", NODE)["metadata"].get("labels", {})


def _patches(api) -> int:
    return sum(1 for r in api.writes() if r.method == "PATCH" and "/nodes/" in r.path)


def _node_labels(client) -> gpulabels.NodeLabels:
    return cli_setup.node_labels(client, NODE)


def _events(api, reason):
    found = [api.get("events", n, "default") for n in api.names("events")]
    return [e for e in found if e and e["reason"] == reason]


def test_publish_once_then_nothing_and_revert_removes_exactly_ours(tmp_path):
    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    with FakeApiServer() as api:
        _node(api, {WORKLOAD_LABEL: "vm-passthrough", "team": "a"})
        node = _node_labels(api.client())
        report = gpulabels.publish(host, discover(host), NAMING, node)
        assert report.ok and report.changes and not report.warnings
        assert {k: _labels(api)[k] for k in KEYS} == DGX
        assert facts.recorded(host) == DGX
        # Nothing differs: no patch.
        api.clear_log()
        assert gpulabels.publish(host, discover(host), NAMING, node).changes == []
        assert _patches(api) == 0
        # Someone changes one of ours: theirs from now on, never removed by us.
        api.update("nodes", NODE, lambda n: n["metadata"]["labels"].__setitem__(MEMORY, "80000"))
        report = gpulabels.publish(host, discover(host), NAMING, node)
        assert "nvidia.com/gpu.memory=80000 was changed by someone else" in report.warnings[0]
        assert MEMORY not in facts.recorded(host)
        report = revert_all(host, Steps(kata=False), None, node_labels=node)
        assert report.ok, report.failures
        assert _labels(api) == {WORKLOAD_LABEL: "vm-passthrough", "team": "a", MEMORY: "80000"}
        assert facts.recorded(host) == {}
        assert not host.state_path(facts.STATE_FILE).exists()


def test_a_label_gfd_or_nfd_set_otherwise_is_left_and_warned_about(tmp_path):
    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    with FakeApiServer() as api:
        # GFD's own value, and NFD's with the same value as ours: neither is ours to remove.
        _node(api, {PRODUCT: "NVIDIA-H100-80GB-HBM3-custom", FAMILY: "hopper"})
        node = _node_labels(api.client())
        report = gpulabels.publish(host, discover(host), NAMING, node)
        assert report.ok
        assert any(PRODUCT in w and "leaves it" in w for w in report.warnings)
        assert _labels(api)[PRODUCT] == "NVIDIA-H100-80GB-HBM3-custom"
        assert set(facts.recorded(host)) == {COUNT, MEMORY, CC_CAPABLE}
        assert revert_all(host, Steps(kata=False), None, node_labels=node).ok
        assert _labels(api) == {PRODUCT: "NVIDIA-H100-80GB-HBM3-custom", FAMILY: "hopper"}


def test_a_label_no_longer_true_is_removed(tmp_path):
    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    with FakeApiServer() as api:
        _node(api, {})
        node = _node_labels(api.client())
        assert gpulabels.publish(host, discover(host), NAMING, node).ok
        # The host's KVM stops running SEV-SNP guests: no cc.capable any more.
        host.path("/sys/module/kvm_amd/parameters/sev_snp").write_text("N\n")
        report = gpulabels.publish(host, discover(host), NAMING, node)
        assert report.changes == [f"node labels {CC_CAPABLE} removed"]
        assert CC_CAPABLE not in _labels(api) and CC_CAPABLE not in facts.recorded(host)


def test_the_agent_publishes_records_an_event_and_reverts_on_exit(tmp_path):
    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    with FakeApiServer() as api:
        _node(api, {PRODUCT: "something-else"})
        client = api.client()
        agent = make_agent(host, NAMING, Steps(kata=False), None, events=EventRecorder(client, NODE),
                      revert_on_exit=True, node_labels=_node_labels(client))
        assert agent.run(once=True) == 0
        assert {k: _labels(api).get(k) for k in KEYS} == {**DGX, PRODUCT: "something-else"}
        assert _events(api, "GpuLabelsSet") and _events(api, "GpuLabelsLeft")
        # Said once: a second check with nothing new records nothing more.
        agent.follow_gpu_labels()
        assert len(_events(api, "GpuLabelsLeft")) == 1
        agent.request_stop()
        agent._loop_and_revert()
        assert _labels(api) == {PRODUCT: "something-else"}


def test_a_revert_that_cannot_reach_the_node_warns_and_keeps_the_record(tmp_path):
    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    facts.record(host, {COUNT: "8"})
    report = revert_all(host, Steps(kata=False), None)
    assert report.ok and "revert again with a node name" in report.warnings[0]
    assert facts.recorded(host) == {COUNT: "8"}
    with FakeApiServer() as api:
        _node(api, {COUNT: "8"})
        client = api.client()
        api.remove("nodes", NODE)  # the API answers 404: the labels cannot be read
        report = revert_all(host, Steps(kata=False), None, node_labels=_node_labels(client))
        assert report.ok and "could not remove the GPU labels" in report.warnings[0]
        assert facts.recorded(host) == {COUNT: "8"}


def test_without_a_node_the_agent_publishes_nothing(tmp_path):
    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    agent = make_agent(host, NAMING, Steps(kata=False), None)
    assert agent.run(once=True) == 0
    assert facts.recorded(host) == {}


def test_katamgr_revert_with_a_cluster_removes_them(tmp_path, monkeypatch, capsys):
    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    with FakeApiServer() as api:
        _node(api, {WORKLOAD_LABEL: "vm-passthrough"})
        assert gpulabels.publish(host, discover(host), NAMING, _node_labels(api.client())).ok
        monkeypatch.setenv("KUBECONFIG", str(api.write_kubeconfig(tmp_path / "kubeconfig")))
        assert cli.main(["revert", "--host-root", str(host.root), "--node-name", NODE]) == 0
        assert "removed node labels" in capsys.readouterr().out
        assert _labels(api) == {WORKLOAD_LABEL: "vm-passthrough"}


def test_plan_shows_the_labels_in_text_and_json(capsys):
    assert cli.main(["plan", "--host", "dgx-h100"]) == 0
    text = capsys.readouterr().out
    assert "GPU labels for the Node" in text
    assert "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3" in text and "nvidia.com/cc.capable=true" in text
    assert cli.main(["plan", "--host", "a10-server", "--output", "json"]) == 0
    section = json.loads(capsys.readouterr().out)["gpuLabels"]
    assert section["labels"] == {PRODUCT: "NVIDIA-A10", FAMILY: "ampere", COUNT: "4", MEMORY: "23028"}
    assert section["enabled"] is True and section["sources"][COUNT].startswith("sysfs")
    assert cli.main(["plan", "--host", "a10-server", "--no-gpu-labels"]) == 0
    assert "not published (--no-gpu-labels)" in capsys.readouterr().out


def test_a_watch_behind_the_agents_own_patch_is_checked_against_the_api_server(tmp_path):
    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    facts.record(host, DGX)
    patches = []
    # The watch has not seen the patch yet (an older count); the API server has.
    node = gpulabels.NodeLabels(read=lambda: {**DGX, COUNT: "7"}, patch=patches.append, read_fresh=lambda: dict(DGX))
    report = gpulabels.publish(host, discover(host), NAMING, node)
    assert report.ok and not report.warnings and not report.changes and patches == []
    assert facts.recorded(host) == DGX
