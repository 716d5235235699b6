"""What the chart guarantees whatever is switched on: isolation on by default, no
pod in the host's network namespace, and resource requests on every container and init
container of every workload, the uninstall hook's included."""

from __future__ import annotations

import pytest
from chartvalues import VALUE_SETS
from support.chartkit import (
    FULL,
    RELEASE,
    is_hook,
    merged,
    pod_containers,
    render,
    workloads,
)

pytestmark = pytest.mark.integration

# Every optional part of the chart on at once.
ALL_ON = merged(FULL, {
    "metrics": {"serviceMonitor": {"enabled": True}},
    "isolation": {"webhook": {"enabled": True, "injectRuntimeClass": True},
                  "admissionPolicy": {"enabled": True}},
    "uninstall": {"revertNodes": True, "deleteRuntimeClasses": True},
    "devices": {"include": [{"ids": "1234:11e8", "resource": "example.com/edu"}]},
    "kataManager": {"ociLayoutDirs": ["/srv/kata-layouts"]},
})
SETS = {**VALUE_SETS, "all-on": ALL_ON}


def where(workload: dict, container: dict) -> str:
    return f"{workload['kind']} {workload['metadata']['name']}, container {container['name']}"


def test_the_defaults_turn_isolation_on_keep_off_the_host_network_and_request_everywhere(chart):
    rendered = render(chart, {})
    # Isolation: the admission policy and the webhook (test_isolation.py has the rest).
    assert rendered.find("ValidatingAdmissionPolicy", "-passthrough-needs-kata") is not None
    assert rendered.find("ValidatingAdmissionPolicyBinding", "-passthrough-needs-kata") is not None
    assert rendered.get("Deployment", "-webhook")["spec"]["replicas"] == 3
    assert rendered.find("ValidatingWebhookConfiguration", "-webhook") is not None
    assert rendered.find("MutatingWebhookConfiguration", "-webhook") is not None
    running = workloads(rendered)
    assert {(w["kind"], w["metadata"]["name"]) for w in running} == {
        ("DaemonSet", f"{RELEASE}-device-plugin"), ("Deployment", f"{RELEASE}-webhook")}
    for workload in running:
        assert not workload["spec"]["template"]["spec"].get("hostNetwork")
        for container in pod_containers(workload):
            assert container["resources"]["requests"], where(workload, container)


def test_all_on_renders_every_workload_and_container(chart):
    rendered = render(chart, ALL_ON)
    names = {(w["kind"], w["metadata"]["name"], c["name"])
             for w in workloads(rendered) for c in pod_containers(w)}
    assert names == {
        ("DaemonSet", f"{RELEASE}-sandbox-agent", "kata-manager"),
        ("DaemonSet", f"{RELEASE}-sandbox-agent", "sandbox-device-plugin"),
        ("DaemonSet", f"{RELEASE}-device-plugin", "device-plugin"),
        ("Deployment", f"{RELEASE}-webhook", "webhook"),
        ("DaemonSet", f"{RELEASE}-revert", "revert"),  # the init container
        ("DaemonSet", f"{RELEASE}-revert", "done"),
        ("Job", f"{RELEASE}-revert-wait", "wait"),
    }
    assert {w["metadata"]["name"] for w in workloads(rendered) if is_hook(w)} == {
        f"{RELEASE}-revert", f"{RELEASE}-revert-wait"}


@pytest.mark.parametrize("values", SETS.values(), ids=SETS.keys())
def test_every_container_of_every_workload_has_requests(chart, values):
    running = workloads(render(chart, values))
    assert running
    for workload in running:
        for container in pod_containers(workload):
            requests = (container.get("resources") or {}).get("requests") or {}
            assert {"cpu", "memory"} <= set(requests), where(workload, container)


@pytest.mark.parametrize("values", SETS.values(), ids=SETS.keys())
def test_no_workload_joins_the_host_network(chart, values):
    for workload in workloads(render(chart, values)):
        pod = workload["spec"]["template"]["spec"]
        assert not pod.get("hostNetwork"), workload["metadata"]["name"]
        assert pod.get("dnsPolicy") != "ClusterFirstWithHostNet", workload["metadata"]["name"]


def test_the_uninstall_helpers_requests_are_a_value(chart):
    own = {"requests": {"cpu": "20m", "memory": "96Mi"}}
    rendered = render(chart, merged(FULL, {"defaultResources": {"uninstall": own}}))
    containers = {c["name"]: c for w in workloads(rendered) for c in pod_containers(w)}
    # Helm merges maps: the default memory limit stays unless set (null removes it).
    for name in ("done", "wait"):
        assert containers[name]["resources"] == {**own, "limits": {"memory": "160Mi"}}
    # The revert is katamgr, as in the agent: the kata-manager container's requests.
    assert containers["revert"]["resources"] == containers["kata-manager"]["resources"]


# The capabilities a container may add, and why (docs/isolation.md, "What each container may
# do"): katamgr without vfioManager finds containerd's PID among the host's processes to
# signal it (containerd.restartMode=signal).
ADDED_CAPABILITIES = {"kata-manager": {"SYS_PTRACE"}}
# The containers that run privileged: katamgr rebinding PCI drivers (vfioManager), and the
# uninstall revert undoing it. Never in plan-only mode.
PRIVILEGED = {"kata-manager", "revert"}
PLAN_ONLY = merged(FULL, {"kataManager": {"planOnly": True}})
WITH_PLAN_ONLY = {**SETS, "plan-only": PLAN_ONLY,
                  "no-vfio": merged(FULL, {"vfioManager": {"enabled": False}})}


@pytest.mark.parametrize("values", WITH_PLAN_ONLY.values(), ids=WITH_PLAN_ONLY.keys())
def test_every_container_has_a_seccomp_profile_and_only_the_capabilities_it_uses(chart, values):
    for workload in workloads(render(chart, values)):
        pod = workload["spec"]["template"]["spec"]
        pod_profile = ((pod.get("securityContext") or {}).get("seccompProfile") or {}).get("type")
        for container in pod_containers(workload):
            context = container.get("securityContext") or {}
            if context.get("privileged"):
                assert container["name"] in PRIVILEGED, where(workload, container)
                continue
            profile = (context.get("seccompProfile") or {}).get("type") or pod_profile
            assert profile == "RuntimeDefault", where(workload, container)
            assert context.get("allowPrivilegeEscalation") is False, where(workload, container)
            capabilities = context.get("capabilities") or {}
            assert capabilities.get("drop") == ["ALL"], where(workload, container)
            assert set(capabilities.get("add") or ()) <= ADDED_CAPABILITIES.get(container["name"], set()), \
                where(workload, container)


def test_the_plan_only_agent_runs_unprivileged_on_the_host_read_only(chart):
    """katamgr run --plan-only only reads (tests/cli/test_plan_only.py runs it with no
    capability at all): the vfioManager's privileges are not given to it."""
    rendered = render(chart, PLAN_ONLY)
    ds = rendered.get("DaemonSet", "-sandbox-agent")
    [agent] = ds["spec"]["template"]["spec"]["containers"]
    assert agent["securityContext"] == {"runAsUser": 0, "privileged": False, "allowPrivilegeEscalation": False,
                                        "capabilities": {"drop": ["ALL"]}}
    assert all(m["readOnly"] for m in agent["volumeMounts"])
    assert not ds["spec"]["template"]["spec"].get("hostPID")
    full = render(chart, FULL).get("DaemonSet", "-sandbox-agent")["spec"]["template"]["spec"]["containers"]
    assert next(c for c in full if c["name"] == "kata-manager")["securityContext"]["privileged"] is True


def test_host_pid_only_where_containerd_is_signalled(chart):
    """hostPID is the sandbox agent pod's (and the revert's) only to signal containerd after
    its config changed; containerd.restartMode=none leaves the reload to the operator and
    the pod, its device plugin or DRA driver included, in its own PID namespace."""
    for values, signalled in ((FULL, True), (merged(FULL, {"containerd": {"restartMode": "none"}}), False),
                              (merged(FULL, {"kataManager": {"enabled": False}}), False)):
        rendered = render(chart, values)
        for workload in workloads(rendered):
            pod = workload["spec"]["template"]["spec"]
            wanted = signalled and workload["metadata"]["name"] in (f"{RELEASE}-sandbox-agent", f"{RELEASE}-revert")
            assert bool(pod.get("hostPID")) is wanted, workload["metadata"]["name"]
