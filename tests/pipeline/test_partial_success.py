"""One runtime class that cannot be installed does not hold the node back, and is not offered.

The node's Kata classes are cluster-wide RuntimeClasses; each one's scheduling.nodeSelector
requires the offer label ``runtimeclass.kata-sandbox-manager.io/<class>=true`` (``kataclasses``),
which the agent sets on its Node for the classes installed and registered with containerd
there, and removes for one that failed. The API server's RuntimeClass admission copies a
class's nodeSelector into each pod that names it (Kubernetes plugin/pkg/admission/runtimeclass),
so the scheduler places such a pod only on a node carrying the label. Here: the agent on a
simulated node against the API stand-in, and ``katamgr apply``/``revert`` as an operator runs
them (exit 3, partly done).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.agentkit import make_agent
from support.apiserver import FakeApiServer
from support.hostkit import GPU_A10, dev, make_host
from support.kataconfig import kata_manager_yaml, prepare_node

from gpunode.host.pciids import PciIds
from gpunode.kataclasses import GPU, GPU_SNP, offer_label
from gpunode.policy.naming import Naming
from katamgr.cluster import EventRecorder, desired_runtime_classes
from katamgr.commands.setup import node_labels as _node_labels
from katamgr.config import parse_config
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.reconcile import Steps

NAMING = Naming(PciIds.find())
NODE = "gpu-node-1"
KATAMGR = str(Path(sys.executable).parent / "katamgr")
GOOD = kata_manager_yaml((GPU, GPU_SNP))
# The -snp class names a registry nobody listens on (the discard port), as the README's
# examples/values/mixed-cluster.yaml names a placeholder mirror for it.
BROKEN = GOOD.replace(f"oci-layout:///opt/kata-artifacts/layout:{GPU_SNP}", "127.0.0.1:9/kata/artifacts:v1")


def node(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4), dev("0000:02:00.0", GPU_A10, "nvidia", 5)])
    return prepare_node(host)


def labels(api) -> dict[str, str]:
    return api.get("nodes", NODE)["metadata"].get("labels") or {}


def test_every_runtime_class_requires_its_offer_label():
    for body in desired_runtime_classes(parse_config(GOOD)):
        name = body["metadata"]["name"]
        assert body["scheduling"]["nodeSelector"][offer_label(name)] == "true"


def test_the_agent_offers_the_classes_it_installed_and_retries_the_one_that_failed(tmp_path):
    host = node(tmp_path)
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {"keep": "me"}}})
        ctx = KataContext(parse_config(BROKEN), manage_runtime_classes=False)
        agent = make_agent(host, NAMING, Steps(), ctx, retry_initial=0.01, retry_max=0.01,
                      offer_labels=_node_labels(api.client(), NODE))
        first = agent.reconcile("start")
        assert first.partly and list(first.classes_failed) == [GPU_SNP]
        # The good class is offered here; the failed one is not, so no -snp pod lands on this node.
        assert labels(api) == {"keep": "me", offer_label(GPU): "true"}
        ready, why = agent.readiness()
        assert not ready and f"runtime class(es) {GPU_SNP} failed and are not offered on this node" in why
        assert "127.0.0.1:9" in why
        sample = agent.metrics.registry.get_sample_value
        assert sample("katamgr_runtime_class_ready", {"runtime_class": GPU}) == 1
        assert sample("katamgr_runtime_class_ready", {"runtime_class": GPU_SNP}) == 0
        assert sample("katamgr_reconciles_total", {"result": "partial"}) == 1
        assert agent.reconciler.retry_at is not None  # retried with backoff, not on the hourly timer

        # The mirror comes back (here: the config's source fixed): the backoff's retry installs it.
        agent.target.ctx = KataContext(parse_config(GOOD), manage_runtime_classes=False)
        again = agent.reconcile("retry", retry=True)
        assert again.ok, again.classes_failed
        assert labels(api) == {"keep": "me", offer_label(GPU): "true", offer_label(GPU_SNP): "true"}
        assert sample("katamgr_runtime_class_ready", {"runtime_class": GPU_SNP}) == 1
        assert agent.readiness()[0]

        # The node leaves vm-passthrough: none of its classes is offered any more.
        agent.target.steps = Steps(workload="container")
        agent.reconcile("relabeled")
        assert labels(api) == {"keep": "me"}


def test_a_class_dropped_from_the_config_is_no_longer_offered(tmp_path):
    """A helm upgrade that drops a class: the agent takes its runtime out of containerd's
    config, so its offer label must go too (Helm may keep the RuntimeClass, with
    uninstall.deleteRuntimeClasses=false, and its pods would land here and fail to start).
    Each label set or removed is an Event of its own, whatever else the reconcile did."""
    host = node(tmp_path)
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {"keep": "me"}}})
        agent = make_agent(host, NAMING, Steps(), KataContext(parse_config(GOOD), manage_runtime_classes=False),
                           offer_labels=_node_labels(api.client(), NODE), events=EventRecorder(api.client(), NODE))
        assert agent.reconcile("start").ok
        assert labels(api) == {"keep": "me", offer_label(GPU): "true", offer_label(GPU_SNP): "true"}
        assert events(api, "RuntimeClassOffered") == [
            f"RuntimeClass {name} is offered on this node ({offer_label(name)}=true): installed and "
            "registered with containerd" for name in (GPU, GPU_SNP)]

        agent.target.ctx = KataContext(parse_config(kata_manager_yaml((GPU,))), manage_runtime_classes=False)
        dropped = agent.reconcile("config changed")
        assert dropped.ok, dropped.failures
        assert f'runtimes.{GPU_SNP}' not in host.path("/etc/containerd/config.toml").read_text().replace('"', "")
        assert labels(api) == {"keep": "me", offer_label(GPU): "true"}
        assert (f"stopped offering runtime class {GPU_SNP} on this node (removed {offer_label(GPU_SNP)})"
                in dropped.changes)
        assert agent.metrics.registry.get_sample_value("katamgr_runtime_class_ready",
                                                       {"runtime_class": GPU_SNP}) is None
        assert events(api, "RuntimeClassNotOffered") == [
            f"RuntimeClass {GPU_SNP} is no longer offered on this node (removed {offer_label(GPU_SNP)})"]


def events(api, reason: str) -> list[str]:
    found = [api.get("events", n, "default") for n in api.names("events")]
    return sorted(e["message"] for e in found if e["reason"] == reason)


def katamgr(*args: str, kubeconfig: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    return subprocess.run([KATAMGR, *args], capture_output=True, text=True, timeout=120, env=env)


def test_apply_labels_the_node_it_set_up_and_revert_takes_the_labels_off(tmp_path):
    host = node(tmp_path)
    config = tmp_path / "kata-manager.yaml"
    config.write_text(BROKEN)
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        where = ["--host-root", str(host.root), "--config", str(config), "--node-name", NODE, "--workload",
                 "vm-passthrough", "--no-runtime-classes"]
        applied = katamgr("apply", *where, kubeconfig=kubeconfig)
        assert applied.returncode == 3, applied.stderr
        assert f"changed: offered runtime class {GPU} on this node ({offer_label(GPU)}=true)" in applied.stdout
        assert labels(api) == {offer_label(GPU): "true"}
        # The same facts as fields of the -o json document, the exit code among them.
        again = katamgr("apply", *where, "-o", "json", kubeconfig=kubeconfig)
        doc = json.loads(again.stdout)
        assert (again.returncode, doc["exitCode"], doc["succeeded"]) == (3, 3, False)
        assert doc["classesReady"] == [GPU] and [c["name"] for c in doc["classesFailed"]] == [GPU_SNP]
        assert GPU_SNP in doc["classesFailed"][0]["message"]
        reverted = katamgr("revert", *where, kubeconfig=kubeconfig)
        assert reverted.returncode == 0, reverted.stderr
        assert f"stopped offering runtime class {GPU} on this node" in reverted.stdout
        assert labels(api) == {}


def test_a_node_installed_from_the_mixed_cluster_example_gets_its_gpus_and_the_other_class(tmp_path):
    """examples/values/mixed-cluster.yaml (the README's) names a placeholder mirror and a pull
    secret not created yet for the -snp class: that class alone fails, by name."""
    import yaml
    from support.paths import REPO

    values = yaml.safe_load((REPO / "examples/values/mixed-cluster.yaml").read_text())
    config = values["kataManager"]["config"]
    gpu = next(rc for rc in config["runtimeClasses"] if rc["name"] == GPU)
    # nvcr.io is not reachable from the test machine: the shipped layout stands in for it.
    gpu["artifacts"]["url"] = f"oci-layout:///opt/kata-artifacts/layout:{GPU}"
    host = node(tmp_path)
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        ctx = KataContext(parse_config(yaml.safe_dump(config)), api.client(), "kata-sandbox-manager",
                          manage_runtime_classes=False)
        agent = make_agent(host, NAMING, Steps(), ctx, offer_labels=_node_labels(api.client(), NODE))
        report = agent.reconcile("start")
        assert report.failures == [] and list(report.classes_failed) == [GPU_SNP]
        assert "pull secret kata-sandbox-manager/registry-mirror does not exist" in report.classes_failed[GPU_SNP]
        assert sorted(report.moved) == ["0000:01:00.0", "0000:02:00.0"]
        assert report.classes_ready == [GPU]
        assert labels(api) == {offer_label(GPU): "true"}
