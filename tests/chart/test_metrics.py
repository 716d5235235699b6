"""The metrics wiring of the chart (templates/metrics.yaml and the DaemonSets): each
container's --metrics-address, named port and probes; the headless Services; the optional
ServiceMonitor; the default resource requests and memory limits; logFormat passed to every
container."""

from __future__ import annotations

from typing import Any

import pytest
from support.chartkit import (
    CHART,
    FULL,
    NAMESPACE,
    RELEASE,
    SANDBOX,
    Rendered,
    cluster_at,
    merged,
    pod_containers,
    render,
    workloads,
)

pytestmark = pytest.mark.integration

KUBE_VERSIONS = ("1.25.0", "1.33.0")
SERVICE_MONITOR = {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}}}}
OFF = {"metrics": {"enabled": False}}
# Every metrics-serving container: (DaemonSet suffix, container, port name, port).
SERVING = [("-sandbox-agent", "kata-manager", "metrics-agent", 9410),
           ("-sandbox-agent", "sandbox-device-plugin", "metrics-plugin", 9411),
           ("-device-plugin", "device-plugin", "metrics-plugin", 9411)]


def option(args: list[str], flag: str) -> str | None:
    assert args.count(flag) <= 1, args
    return args[args.index(flag) + 1] if flag in args else None


def containers(rendered: Rendered) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for _, c in rendered.containers()}


def pod_labels(rendered: Rendered, suffix: str) -> dict[str, str]:
    return rendered.get("DaemonSet", suffix)["spec"]["template"]["metadata"]["labels"]


# --- on by default -----------------------------------------------------------------------

@pytest.mark.parametrize("values", [FULL, merged(FULL, {"containerd": {"restartMode": "none"}})],
                         ids=["signal-mode", "no-restart"])
def test_defaults_give_each_container_its_address_port_and_probes(chart, values):
    rendered = render(chart, values)
    by_name = containers(rendered)
    for _suffix, name, port_name, port in SERVING:
        c = by_name[name]
        assert option(c["args"], "--metrics-address") == f"0.0.0.0:{port}"
        assert c["ports"] == [{"name": port_name, "containerPort": port, "protocol": "TCP"}]
        startup, liveness, readiness = c["startupProbe"], c["livenessProbe"], c["readinessProbe"]
        for probe, path in ((startup, "/healthz"), (liveness, "/healthz"), (readiness, "/readyz")):
            assert probe["httpGet"] == {"path": path, "port": port_name}
            assert probe["timeoutSeconds"] >= 1
        # Liveness waits for startup and tolerates a minute of missed answers.
        assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60
        assert "initialDelaySeconds" not in liveness
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 60
    agent = by_name["kata-manager"]["startupProbe"]
    assert agent["periodSeconds"] * agent["failureThreshold"] == 120
    # No pod joins the host network: probes and scrapes reach the pod IP.
    for ds in rendered.daemonsets():
        assert not ds["spec"]["template"]["spec"].get("hostNetwork")


def test_the_sandbox_agent_is_never_on_the_host_network(chart):
    for values in (FULL, merged(FULL, {"containerd": {"restartMode": "none"}}), SANDBOX):
        pod = render(chart, values).get("DaemonSet", "-sandbox-agent")["spec"]["template"]["spec"]
        assert not pod.get("hostNetwork")


def test_custom_ports_reach_args_ports_and_services(chart):
    rendered = render(chart, merged(FULL, {"metrics": {"agentPort": 19000, "pluginPort": 19001}}))
    by_name = containers(rendered)
    assert option(by_name["kata-manager"]["args"], "--metrics-address") == "0.0.0.0:19000"
    assert by_name["device-plugin"]["ports"][0]["containerPort"] == 19001
    service = rendered.get("Service", "-sandbox-agent-metrics")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "metrics-agent": 19000, "metrics-plugin": 19001}


@pytest.mark.parametrize("values", [FULL, {}, merged(FULL, {"sandboxDevicePlugin": {"enabled": False}}),
                                    merged(SANDBOX, {"vfioManager": {"enabled": False},
                                                     "cdi": {"enabled": False}})],
                         ids=["full", "defaults", "agent-without-plugin", "plugin-without-agent"])
def test_each_daemonset_has_a_headless_service_for_its_metrics_ports(chart, values):
    rendered = render(chart, values)
    for ds in rendered.daemonsets():
        suffix = ds["metadata"]["name"][len(RELEASE):]
        service = rendered.get("Service", f"{suffix}-metrics")
        spec = service["spec"]
        assert spec["clusterIP"] == "None"
        assert spec["publishNotReadyAddresses"] is True
        labels = pod_labels(rendered, suffix)
        assert spec["selector"].items() <= labels.items()
        assert spec["selector"]["app.kubernetes.io/component"] == labels["app.kubernetes.io/component"]
        ports = {p["name"]: p["containerPort"]
                 for c in ds["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        assert ports
        assert {p["name"]: p["port"] for p in spec["ports"]} == ports
        assert all(p["targetPort"] == p["name"] for p in spec["ports"])
    services = [o for o in rendered.objects
                if o["kind"] == "Service" and o["metadata"]["name"].endswith("-metrics")]
    assert len(services) == len(rendered.daemonsets())


def test_metrics_services_select_no_other_pods(chart):
    rendered = render(chart, merged(FULL, {"isolation": {"webhook": {"enabled": True}}}))
    webhook_pod = rendered.get("Deployment", "-webhook")["spec"]["template"]["metadata"]["labels"]
    for suffix in ("-sandbox-agent-metrics", "-device-plugin-metrics"):
        selector = rendered.get("Service", suffix)["spec"]["selector"]
        assert not selector.items() <= webhook_pod.items()
    assert not (rendered.get("Service", "-sandbox-agent-metrics")["spec"]["selector"].items()
                <= pod_labels(rendered, "-device-plugin").items())


# --- off -----------------------------------------------------------------------------------

@pytest.mark.parametrize("values", [merged(FULL, OFF), OFF, {"metrics": None}],
                         ids=["full", "defaults", "no-metrics-block"])
def test_metrics_off_renders_none_of_it(chart, values):
    # metrics: null is what helm upgrade --reuse-values from an older release looks like.
    rendered = render(chart, values)
    for _, c in rendered.containers():
        assert "--metrics-address" not in c["args"]
        assert not {"ports", "startupProbe", "livenessProbe", "readinessProbe"} & set(c)
        assert option(c["args"], "--log-format") == "text"
    assert not [o for o in rendered.objects if o["kind"] == "ServiceMonitor"
                or o["metadata"]["name"].endswith("-metrics")]


# --- the ServiceMonitor ----------------------------------------------------------------------

def test_no_service_monitor_by_default(chart):
    for values in (FULL, {}):
        assert render(chart, values).find("ServiceMonitor") is None


def test_service_monitor_when_enabled_scrapes_both_services(chart):
    rendered = render(chart, merged(FULL, SERVICE_MONITOR))
    monitor = rendered.get("ServiceMonitor")
    # kubernetes-validate does not know the CRD: its shape, by hand (monitoring.coreos.com/v1).
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == NAMESPACE
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    spec = monitor["spec"]
    assert set(spec) == {"namespaceSelector", "selector", "endpoints"}
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    selector = spec["selector"]
    assert set(selector) == {"matchLabels", "matchExpressions"}
    selected = []
    for obj in rendered.objects:
        labels = obj["metadata"].get("labels", {})
        if obj["kind"] != "Service":
            continue
        matches = selector["matchLabels"].items() <= labels.items() and all(
            (labels.get(e["key"]) in e["values"]) == (e["operator"] == "In")
            for e in selector["matchExpressions"])
        if matches:
            selected.append(obj["metadata"]["name"])
    assert sorted(selected) == [f"{RELEASE}-device-plugin-metrics", f"{RELEASE}-sandbox-agent-metrics"]
    service_ports = {p["name"] for name in selected
                     for p in rendered.get("Service", name[len(RELEASE):])["spec"]["ports"]}
    endpoints = spec["endpoints"]
    assert {e["port"] for e in endpoints} == service_ports == {"metrics-agent", "metrics-plugin"}
    for endpoint in endpoints:
        assert set(endpoint) <= {"port", "path", "scheme", "interval", "scrapeTimeout", "relabelings"}
        assert endpoint["path"] == "/metrics" and endpoint["scheme"] == "http"
        assert endpoint["interval"] == "30s"
        assert "scrapeTimeout" not in endpoint
        assert endpoint["relabelings"] == [{"sourceLabels": ["__meta_kubernetes_pod_node_name"],
                                            "targetLabel": "node", "action": "replace"}]


def test_service_monitor_follows_the_daemonsets_and_its_settings(chart):
    values = merged({}, SERVICE_MONITOR, {"metrics": {"serviceMonitor": {
        "interval": "1m", "scrapeTimeout": "20s"}}})
    monitor = render(chart, values).get("ServiceMonitor")  # container plugin only
    assert monitor["spec"]["selector"]["matchExpressions"][0]["values"] == ["device-plugin"]
    assert [(e["port"], e["interval"], e["scrapeTimeout"]) for e in monitor["spec"]["endpoints"]] == [
        ("metrics-plugin", "1m", "20s")]
    agent_only = render(chart, merged(FULL, SERVICE_MONITOR, {"sandboxDevicePlugin": {"enabled": False},
                                                              "devicePlugin": {"enabled": False}}))
    assert [e["port"] for e in agent_only.get("ServiceMonitor")["spec"]["endpoints"]] == ["metrics-agent"]


# --- every object valid; lint clean -------------------------------------------------------

VALID_SETS = {
    "full-service-monitor": merged(FULL, SERVICE_MONITOR),
    "defaults-service-monitor": SERVICE_MONITOR,
    "full-metrics-off-json": merged(FULL, OFF, {"logFormat": "json"}),
    "pod-network-custom-ports": merged(FULL, {"containerd": {"restartMode": "none"},
                                              "metrics": {"agentPort": 19000, "pluginPort": 19001}}),
    "plugin-only-webhook": merged(SANDBOX, {"vfioManager": {"enabled": False}, "cdi": {"enabled": False},
                                            "isolation": {"webhook": {"enabled": True}},
                                            "logFormat": "json"}),
}


@pytest.mark.parametrize("values", VALID_SETS.values(), ids=VALID_SETS.keys())
def test_every_core_object_is_valid_for_kubernetes(chart, kube_validate, values):
    problems = []
    for version in KUBE_VERSIONS:
        for obj in render(chart, values, cluster_at(version)).objects:
            if obj["apiVersion"].startswith(("monitoring.coreos.com/", "cert-manager.io/")):
                continue  # CRDs kubernetes-validate does not know; checked by hand above
            try:
                kube_validate.validate(obj, version, strict=True)
            except kube_validate.ValidationError as exc:
                where = "/".join(str(p) for p in exc.absolute_path)
                problems.append(f"{version} {obj['kind']}/{obj['metadata']['name']} at {where}: {exc.message}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("values", VALID_SETS.values(), ids=VALID_SETS.keys())
def test_helm_lint_is_clean(helm, values):
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


# --- resources -------------------------------------------------------------------------------

def test_every_container_has_requests_and_a_memory_limit_by_default(chart):
    """The limits are measured (bench/bench_memory.py, values.yaml says the figures); none
    limits CPU, which would throttle the device plugins' answers to the kubelet."""
    every = {}
    for dra in (False, True):  # the DRA driver takes the sandbox device plugin's place
        values = merged(FULL, {"dra": {"enabled": dra}, "uninstall": {"revertNodes": True},
                               "isolation": {"webhook": {"enabled": True}}})
        every.update({c["name"]: c for w in workloads(render(chart, values)) for c in pod_containers(w)})
    assert {"kata-manager", "sandbox-device-plugin", "dra-driver", "device-plugin", "webhook",
            "revert", "done", "wait"} <= set(every)
    for name, container in every.items():
        resources = container.get("resources", {})
        assert resources.get("requests", {}).get("memory"), name
        assert resources.get("limits", {}).get("memory"), f"{name} has no memory limit"
        assert "cpu" not in resources.get("limits", {}), name
    assert every["kata-manager"]["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi"},
                                                  "limits": {"memory": "256Mi"}}
    assert every["revert"]["resources"] == every["kata-manager"]["resources"]
    assert every["sandbox-device-plugin"]["resources"]["limits"] == {"memory": "192Mi"}
    assert every["dra-driver"]["resources"] == every["sandbox-device-plugin"]["resources"]
    assert every["device-plugin"]["resources"]["limits"] == {"memory": "128Mi"}


def test_operand_and_gpu_operator_resources_win_over_the_defaults(chart):
    own = {"requests": {"cpu": "1"}, "limits": {"memory": "1Gi"}}
    by_name = containers(render(chart, merged(FULL, {
        "vfioManager": {"resources": own},                   # GPU Operator block, fills in
        "kataSandboxDevicePlugin": {"resources": own},       # GPU Operator block, fills in
        "devicePlugin": {"resources": own},
    })))
    assert all(c["resources"] == own for c in by_name.values())
    # {} would merge into the default (Helm merges maps); null removes it.
    none = containers(render(chart, merged(FULL, {"defaultResources": {"kataManager": None}})))
    assert "resources" not in none["kata-manager"]


# --- logFormat ---------------------------------------------------------------------------------

def test_log_format_reaches_every_container_and_each_command_parses_it(chart):
    from katamgr import cli as katamgr_cli
    from sandbox_plugin import cli as plugin_cli

    values = merged(FULL, {"logFormat": "json", "isolation": {"webhook": {"enabled": True}}})
    rendered = render(chart, values)
    webhook = rendered.get("Deployment", "-webhook")["spec"]["template"]["spec"]["containers"][0]
    assert "--log-format=json" in webhook["args"]
    assert katamgr_cli.build_parser().parse_args([*webhook["command"][1:], *webhook["args"]]).log_format == "json"
    seen = set()
    for _, c in rendered.containers():
        assert option(c["args"], "--log-format") == "json"
        args = [a.replace("$(NODE_NAME)", "gpu-node-1") for a in c["args"]]
        parser = katamgr_cli.build_parser() if c["command"] == ["katamgr"] else plugin_cli.build_parser()
        parsed = parser.parse_args(args)
        assert parsed.log_format == "json"
        assert parsed.metrics_address == option(c["args"], "--metrics-address")
        seen.add(c["name"])
    assert seen == {"kata-manager", "sandbox-device-plugin", "device-plugin"}


# --- bad values ----------------------------------------------------------------------------

@pytest.mark.parametrize(("values", "fragments"), [
    ({"logFormat": "xml"}, ["/logFormat", "json"]),
    ({"metrics": {"agentPort": 80}}, ["/metrics/agentPort"]),
    ({"metrics": {"pluginPort": "9411"}}, ["/metrics/pluginPort", "integer"]),
    ({"metrics": {"serviceMonitor": {"interval": "30 seconds"}}}, ["/metrics/serviceMonitor/interval"]),
    ({"metrics": {"scrape": True}}, ["/metrics", "'scrape'"]),
    ({"defaultResources": {"agent": {}}}, ["/defaultResources", "'agent'"]),
], ids=["log-format", "privileged-port", "port-string", "interval", "unknown-key", "unknown-operand"])
def test_schema_rejects_bad_metrics_values(helm, chart, values, fragments):
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    for fragment in fragments:
        assert fragment in str(caught.value), str(caught.value)


@pytest.mark.parametrize(("values", "fragment"), [
    ({"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}}, "needs metrics.enabled=true"),
    ({"metrics": {"agentPort": 9500, "pluginPort": 9500}}, "are both 9500"),
], ids=["monitor-without-metrics", "same-ports"])
def test_values_the_chart_cannot_honour_are_refused_saying_why(chart, values, fragment):
    with pytest.raises(Exception, match=fragment):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
