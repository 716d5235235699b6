"""``katamgr --no-runtime-classes`` (``KataContext.manage_runtime_classes=False``): the chart's
Helm owns the cluster's RuntimeClasses, so katamgr run by the chart applies, updates and
deletes none (its ServiceAccount may not), and says so in its plan; run by hand without the
flag it keeps applying them (test_reconcile.py). The official client against the API
stand-in, and the command as the chart runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.apiserver import FakeApiServer
from support.hostkit import GPU_A10, dev, make_host
from support.kataconfig import kata_manager_yaml, prepare_node

from gpunode.host.pciids import PciIds
from gpunode.kataclasses import GPU, GPU_SNP
from gpunode.policy.naming import Naming
from katamgr.config import parse_config
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.reconcile import Steps, full_plan, reconcile, revert_all

KATAMGR = str(Path(sys.executable).parent / "katamgr")
NAMING = Naming(PciIds.find())
CONFIG = kata_manager_yaml((GPU, GPU_SNP))


def node(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4)])
    return prepare_node(host)


def test_the_chart_flag_writes_no_runtime_class_and_the_rest_of_the_chain_runs(tmp_path):
    host = node(tmp_path)
    with FakeApiServer() as api:
        ctx = KataContext(parse_config(CONFIG), api.client(), "gpu-operator", manage_runtime_classes=False)
        report = reconcile(host, NAMING, Steps(), ctx)
        assert report.ok, report.failures
        assert any("edited /etc/containerd/config.toml" in c for c in report.changes)
        assert not [c for c in report.changes + report.warnings if "RuntimeClass" in c]
        assert api.names("runtimeclasses") == []
        assert not [r for r in api.writes() if "runtimeclasses" in r.path]

        plan = full_plan(host, NAMING, Steps(), ctx)
        section = next(s for s in plan.sections if s.key == "runtimeClasses")
        assert section.data["managed"] is False
        assert [o["handler"] for o in section.data["objects"]] == [GPU, GPU_SNP]
        assert section.lines == [f"leave RuntimeClass {n}: managed elsewhere, by the chart "
                                 "(--no-runtime-classes)" for n in (GPU, GPU_SNP)]


def test_a_revert_under_the_flag_deletes_no_class_even_when_asked(tmp_path):
    host = node(tmp_path)
    with FakeApiServer() as api:
        # Classes there already (Helm's, or an earlier hand-run katamgr's, labeled as ours).
        reconcile(node(tmp_path / "other"), NAMING, Steps(), KataContext(parse_config(CONFIG), api.client()))
        assert sorted(api.names("runtimeclasses")) == [GPU, GPU_SNP]
        ctx = KataContext(parse_config(CONFIG), api.client(), manage_runtime_classes=False)
        reconcile(host, NAMING, Steps(), ctx)
        api.clear_log()
        report = revert_all(host, Steps(), ctx, delete_runtime_classes=True)
        assert any("managed elsewhere, by the chart" in f for f in report.failures)
        assert sorted(api.names("runtimeclasses")) == [GPU, GPU_SNP]
        assert not [r for r in api.writes() if "runtimeclasses" in r.path]
        # The node itself is reverted all the same.
        assert any("restored" in c for c in report.changes)


def test_the_command_refuses_the_contradiction_and_plans_with_the_flag(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    refused = subprocess.run([KATAMGR, "revert", "--host", "a10-server", "--config", str(config),
                              "--no-runtime-classes", "--delete-runtimeclasses"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert "--delete-runtimeclasses and --no-runtime-classes contradict each other" in refused.stderr
    plan = subprocess.run([KATAMGR, "plan", "--host", "a10-server", "--config", str(config),
                           "--no-runtime-classes", "--output", "json"],
                          capture_output=True, text=True, timeout=120)
    # 4: the profile's node holds no artifact layout, so plan's manifest check names both classes.
    assert plan.returncode == 4, plan.stderr
    planned = json.loads(plan.stdout)
    assert planned["runtimeClasses"]["managed"] is False
    assert [p["message"].split(":")[0] for p in planned["problems"]] == [f"runtime class {GPU}", f"runtime class {GPU_SNP}"]
