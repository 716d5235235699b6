"""The chart's alerts and dashboard (templates/prometheusrule.yaml, grafana-dashboard.yaml):
off by default, rendered when asked, and every query names only series something exports:
our programs' registries, or the few named below from kube-state-metrics, Prometheus and
the API server."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml
from support.chartkit import CHART, FULL, NAMESPACE, RELEASE, merged, part_missing, render
from support.paths import REPO
from support.promql import exposed_names, metric_names

from katamgr.agent.metrics import AgentMetrics
from sandbox_plugin.metrics import PluginMetrics

pytestmark = pytest.mark.integration

RULES = {"metrics": {"prometheusRule": {"enabled": True, "labels": {"release": "kps"}}}}
DASHBOARD = {"metrics": {"grafanaDashboard": {"enabled": True}}}
DASHBOARD_FILE = CHART / "dashboards" / "kata-sandbox-manager.json"

# Series of other programs the queries may read, with where each is defined.
OTHERS = {
    # kube-state-metrics, docs/metrics/workload/pod-metrics.md: condition true/false/unknown.
    "kube_pod_status_ready",
    # Prometheus's own per-target scrape health (docs: "Jobs and instances").
    "up",
    # kube-apiserver, staging/src/k8s.io/apiserver/pkg/admission/metrics/metrics.go: the API
    # server's calls to admission webhooks, labelled name (the webhook's), type, operation.
    "apiserver_admission_webhook_admission_duration_seconds_bucket",
    "apiserver_admission_webhook_rejection_count",
    "apiserver_admission_webhook_fail_open_count",
}


def ours() -> set[str]:
    plugin = PluginMetrics()
    plugin.nvlink_model = "none"  # the gauge exists only on a node with NVSwitches
    return exposed_names([AgentMetrics().registry, plugin.registry])


def rules(chart, values=None) -> list[dict]:
    rule = render(chart, merged(FULL, values or RULES)).get("PrometheusRule")
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def dashboard_exprs(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):  # label_values(metric, label): the metric is the first argument
            exprs.append(query["query"].removeprefix("label_values(").split(",")[0])
    return exprs


def test_the_extractor_reads_selectors_not_labels_functions_or_keywords():
    expr = ('histogram_quantile(0.99, sum by (le, name) (rate(a_bucket{name=~"x.y", b="c d"}[5m]))) > 1 '
            'and on (node) b_total offset 1h unless ignoring(x) c or vector(0) * bool 2e3 + $__rate_interval')
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}
    assert metric_names('katamgr_nope{node=~"$node"} == 0') == {"katamgr_nope"}


def test_nothing_renders_by_default(chart):
    kinds = {o["kind"] for o in render(chart, FULL).objects}
    assert "PrometheusRule" not in kinds
    assert not [o for o in render(chart, FULL).objects
                if o["kind"] == "ConfigMap" and "grafana_dashboard" in o["metadata"].get("labels", {})]


def test_every_alert_reads_only_series_that_exist(chart):
    known = ours() | OTHERS
    found = set()
    for rule in rules(chart):
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        assert names <= known, f"{rule['alert']} reads {sorted(names - known)}, which nothing exports"
        found |= names
    # The alerts the on-call needs are there, each on its source.
    assert {"katamgr_runtime_class_ready", "katamgr_gpu_unhealthy", "katamgr_gpu_handback_failed",
            "katamgr_devices", "kube_pod_status_ready", "up",
            "apiserver_admission_webhook_rejection_count"} <= found


def test_every_dashboard_query_reads_only_series_that_exist():
    known = ours() | OTHERS
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    for expr in dashboard_exprs(dashboard):
        names = metric_names(expr)
        assert names and names <= known, f"{expr!r} reads {sorted(names - known)}, which nothing exports"


def test_every_alert_has_a_severity_summary_and_description(chart):
    for rule in rules(chart):
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"]["summary"].strip() and rule["annotations"]["description"].strip(), rule["alert"]
        assert rule["alert"].startswith("KataSandbox")
    names = [r["alert"] for r in rules(chart)]
    assert len(names) == len(set(names))


def test_the_rule_names_this_release_and_keeps_prometheus_templates(chart):
    rule = render(chart, merged(FULL, RULES)).get("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == NAMESPACE and rule["metadata"]["labels"]["release"] == "kps"
    by_name = {r["alert"]: r for r in rules(chart)}
    up = by_name["KataSandboxMetricsDown"]["expr"]
    # The ServiceMonitor's job label is the Service's name.
    assert f'job=~"{RELEASE}-(sandbox-agent|device-plugin)-metrics"' in up and f'namespace="{NAMESPACE}"' in up
    assert "KSM_" not in yaml.safe_dump(rule)
    assert "{{ $labels.node }}" in by_name["KataSandboxRuntimeClassFailed"]["annotations"]["summary"]


def test_the_webhook_alerts_name_the_webhooks_the_chart_renders(chart):
    rendered = render(chart, merged(FULL, RULES, {"isolation": {"webhook": {"enabled": True}}}))
    webhooks = [w["name"] for o in rendered.objects if o["kind"].endswith("WebhookConfiguration")
                for w in o["webhooks"]]
    assert webhooks
    for rule in rules(chart):
        if "apiserver_admission" in rule["expr"]:
            pattern = re.search(r'name=~"([^"]+)"', rule["expr"]).group(1).replace("\\\\", "\\")
            assert all(re.fullmatch(pattern, w) for w in webhooks), (rule["alert"], pattern)


def test_the_dashboard_is_a_sidecar_configmap_of_valid_json_with_unique_panel_ids(chart):
    cm = render(chart, merged(FULL, DASHBOARD, {"metrics": {"grafanaDashboard": {
        "namespace": "monitoring", "annotations": {"grafana_folder": "GPU nodes"}}}})).get("ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "GPU nodes"}
    dashboard = json.loads(cm["data"]["kata-sandbox-manager.json"])
    assert dashboard == json.loads(DASHBOARD_FILE.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), ids
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"GPUs by state", "Allocate calls", "GPU health transitions", "Workload switch duration (p90)",
            "Webhook latency (p99)"} <= titles


@pytest.mark.parametrize("values", [{"metrics": {"prometheusRule": None, "grafanaDashboard": None}},
                                    {"metrics": None}], ids=["null-blocks", "no-metrics-block"])
def test_null_blocks_from_an_older_release_render_neither(chart, values):
    kinds = {o["kind"] for o in render(chart, merged(FULL, values)).objects}
    assert "PrometheusRule" not in kinds


def test_prometheuss_own_parser_reads_every_query_and_finds_the_same_names(chart):
    """Prometheus's PromQL parser (hack/promql: promql/parser, pinned), built with Go as the
    h2spec harness is: every query parses, and its selectors name what metric_names found."""
    if not (shutil.which("go") or (REPO / ".venv/bin/go").exists()):
        part_missing("no Go toolchain to build Prometheus's PromQL parser (hack/promql/build)")
    built = subprocess.run([str(REPO / "hack/promql/build")], capture_output=True, text=True, timeout=1800,
                           check=False)
    assert built.returncode == 0, built.stderr
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    exprs = [r["expr"] for r in rules(chart)] + [
        # Grafana's interval variable is put in before Prometheus sees a query.
        t["expr"].replace("$__rate_interval", "5m") for p in dashboard["panels"] for t in p.get("targets", [])]
    parsed = json.loads(subprocess.run([built.stdout.strip()], input=json.dumps(exprs), capture_output=True,
                                       text=True, timeout=60, check=True).stdout)
    for expr, answer in zip(exprs, parsed, strict=True):
        assert not answer.get("error"), (expr, answer["error"])
        assert set(answer["names"]) == metric_names(expr), expr
