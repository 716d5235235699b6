"""Dynamic Resource Allocation in the chart (dra.*): the DRA driver in the sandbox agent
pod in place of the sandbox device plugin, its host mounts and RBAC, the DeviceClasses and
what their CEL selects among the devices the driver publishes, and the values refused."""

from __future__ import annotations

import pytest
from chartvalues import NODE_ARGS
from support.chartkit import (
    FULL,
    SANDBOX,
    cluster_at,
    container,
    container_names,
    host_mounts,
    merged,
    render,
    rules,
)

from gpunode.kataclasses import PASSTHROUGH_RUNTIME_CLASSES

DRIVER = "passthrough.kata-sandbox-manager.io"
DRA = merged(FULL, {"dra": {"enabled": True}})

pytestmark = pytest.mark.integration


def test_off_by_default(chart):
    for values in ({}, SANDBOX, FULL):
        rendered = render(chart, values)
        assert not [o for o in rendered.objects if o["kind"] == "DeviceClass"]
        assert all(c["name"] != "dra-driver" for _, c in rendered.containers())
        for role in (o for o in rendered.objects if o["kind"] == "ClusterRole"):
            assert all("resource.k8s.io" not in r["apiGroups"] for r in role["rules"])
    # Without sandbox workloads nothing of the sandbox runs, DRA included.
    rendered = render(chart, {"dra": {"enabled": True}})
    assert not [o for o in rendered.objects if o["kind"] == "DeviceClass"]


def test_the_driver_replaces_the_sandbox_device_plugin(chart):
    rendered = render(chart, DRA)
    # One or the other per node: with dra on, no pod advertises nvidia.com/<model>.
    assert container_names(rendered, "-sandbox-agent") == ["kata-manager", "dra-driver"]
    driver = container(rendered, "-sandbox-agent", "dra-driver")
    assert driver["command"] == ["sandbox-dra-driver"]
    assert driver["args"] == ["--driver-name", DRIVER, *NODE_ARGS,
                              *[a for c in PASSTHROUGH_RUNTIME_CLASSES for a in ("--kata-runtime-class", c)],
                              "--kata-handler", "kata", "--kata-handler", "kata-*",
                              "--kata-gpu-handler", "kata-qemu-nvidia-gpu*",
                              "--containerd-config", "/etc/containerd/config.toml"]
    assert driver["securityContext"]["privileged"] is False
    assert driver["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert driver["securityContext"]["readOnlyRootFilesystem"] is True
    assert host_mounts(rendered, "-sandbox-agent", "dra-driver") == {
        "/host/var/lib/kubelet/plugins_registry": ("/var/lib/kubelet/plugins_registry", False),
        f"/host/var/lib/kubelet/plugins/{DRIVER}": (f"/var/lib/kubelet/plugins/{DRIVER}", False),
        "/host/sys": ("/sys", True),
        "/host/dev/vfio": ("/dev/vfio", True),
        "/host/var/run/cdi": ("/var/run/cdi", True),
        # The agent's hand-back verdicts: a GPU that failed its check stays out of the slice.
        "/host/var/lib/kata-sandbox-manager/handback": ("/var/lib/kata-sandbox-manager/handback", True),
        # The node's Kata, read-only: its release decides as the agent's does.
        "/host/etc/containerd": ("/etc/containerd", True),
        "/host/opt/kata": ("/opt/kata", True),
    }
    assert driver["resources"] == {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "192Mi"}}
    pod = rendered.get("DaemonSet", "-sandbox-agent")["spec"]["template"]["spec"]
    mounted = {m["name"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
    assert mounted == {v["name"] for v in pod["volumes"]}
    # No device-plugin socket dir: nothing here registers a device plugin.
    assert "device-plugins" not in mounted


def test_the_driver_gets_the_same_devices_and_naming_as_katamgr(chart):
    values = merged(DRA, {"devices": {"include": [{"ids": "1234:11e8", "resource": "example.com/edu"}],
                                      "exclude": ["0000:01:00.0"]},
                          "sandboxDevicePlugin": {"alias": "pgpu"},
                          "dra": {"driverName": "vfio.example.com", "resources": {"requests": {"cpu": "10m"}}}})
    rendered = render(chart, values)
    agent = container(rendered, "-sandbox-agent", "kata-manager")
    driver = container(rendered, "-sandbox-agent", "dra-driver")
    shared = [a for a in agent["args"] if a.startswith("--") and a not in (
        "--config", "--host-root", "--log-format", "--metrics-address", "--default-workload",
        "--no-runtime-classes")]  # katamgr's own: the driver never touches RuntimeClasses
    for flag in shared:
        assert flag in driver["args"], flag
    assert driver["args"][driver["args"].index("--driver-name") + 1] == "vfio.example.com"
    assert "/host/var/lib/kubelet/plugins/vfio.example.com" in host_mounts(rendered, "-sandbox-agent", "dra-driver")
    assert driver["resources"] == {"requests": {"cpu": "10m"}}
    on_root = render(chart, merged(values, {"hostPaths": {"rootFS": "/srv/node"}}))
    args = container(on_root, "-sandbox-agent", "dra-driver")["args"]
    assert args[args.index("--runtime-root") + 1] == "/srv/node"  # where the kubelet dials dra.sock
    assert host_mounts(on_root, "-sandbox-agent", "dra-driver")["/host/var/lib/kubelet/plugins_registry"] == (
        "/srv/node/var/lib/kubelet/plugins_registry", False)
    custom = render(chart, merged(values, {"isolation": {"runtimeClasses": ["kata-fc"]}}))
    args = container(custom, "-sandbox-agent", "dra-driver")["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--kata-runtime-class"] == ["kata-fc"]
    # The handlers a class is judged by are isolation's, as the admission layers take them.
    custom = render(chart, merged(values, {"isolation": {"kataGpuHandlers": ["lab-gpu-*"], "kataHandlers": ["lab"]}}))
    args = container(custom, "-sandbox-agent", "dra-driver")["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a in ("--kata-handler", "--kata-gpu-handler")] == [
        "lab", "lab-gpu-*"]
    classes = sorted(o["metadata"]["name"] for o in rendered.objects if o["kind"] == "DeviceClass")
    assert classes == ["gpu.vfio.example.com", "nvswitch.vfio.example.com"]


def test_rbac_is_what_the_driver_calls(chart):
    role = rules(render(chart, DRA).get("ClusterRole", "-sandbox-agent"))
    assert role["resourceslices"] == {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"],
                                      "verbs": ["list", "create", "update", "delete"]}
    assert role["resourceclaims"] == {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"],
                                      "verbs": ["get"]}
    # The runtime class of the pods a claim is reserved for, read one by one.
    assert role["pods"] == {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}
    assert "pods" not in rules(render(chart, FULL).get("ClusterRole", "-sandbox-agent"))
    # Its node's workload label; patch for the agent's GPU labels (gpuLabels.enabled, the default).
    assert role["nodes"]["verbs"] == ["get", "watch", "patch"]


def test_device_classes_select_this_drivers_devices_by_type(chart, tmp_path):
    celpy = pytest.importorskip("celpy")
    from gpunode.host.pciids import PciIds
    from gpunode.policy.naming import Naming
    from gpunode.policy.selection import Selection
    from katamgr.pipeline.devices import apply_host
    from katamgr.pipeline.plan import build_plan
    from nodesim.materialise import materialise
    from nodesim.profiles import find_profile
    from sandbox_plugin.dra.devices import describe
    from sandbox_plugin.units import scan_units

    naming = Naming(PciIds.find(), selection=Selection(nvswitches=True))  # NVSwitches opted in
    host = materialise(find_profile("dgx-h100"), tmp_path)
    apply_host(host, build_plan(host, naming))
    devices = describe(scan_units(host, naming), naming)
    classes = {o["metadata"]["name"]: o for o in render(chart, DRA).objects if o["kind"] == "DeviceClass"}
    assert sorted(classes) == [f"gpu.{DRIVER}", f"nvswitch.{DRIVER}"]
    env = celpy.Environment()
    selected = {}
    for name, device_class in classes.items():
        (selector,) = device_class["spec"]["selectors"]
        program = env.program(env.compile(selector["cel"]["expression"]))
        for driver in (DRIVER, "gpu.nvidia.com"):
            selected[(name, driver)] = sorted(
                d.name for d in devices if program.evaluate({"device": celpy.json_to_cel({
                    "driver": driver, "attributes": {driver: dict(d.attributes)}})}))
    assert len(selected[(f"gpu.{DRIVER}", DRIVER)]) == 8
    assert all(n.startswith("gpu-") for n in selected[(f"gpu.{DRIVER}", DRIVER)])
    assert len(selected[(f"nvswitch.{DRIVER}", DRIVER)]) == 4
    # Another driver's devices of the same type are never selected.
    assert selected[(f"gpu.{DRIVER}", "gpu.nvidia.com")] == []


@pytest.mark.parametrize(("values", "message"), [
    ({"dra": {"enabled": True, "driverName": "gpu.nvidia.com"}},
     "dra.driverName=gpu.nvidia.com is a driver name of NVIDIA's DRA driver for GPUs"),
])
def test_a_clashing_driver_name_is_refused(chart, values, message):
    with pytest.raises(Exception, match=message):
        render(chart, merged(FULL, values))


@pytest.mark.parametrize("name", ["Passthrough.Example.com", "a" * 64, "-bad.example.com", ""])
def test_the_schema_refuses_a_driver_name_that_is_no_dns_subdomain(chart, name):
    with pytest.raises(Exception, match="driverName"):
        render(chart, merged(FULL, {"dra": {"enabled": True, "driverName": name}}))


def test_an_old_cluster_is_told_dra_needs_1_34(chart):
    with pytest.raises(Exception, match="dra.enabled=true needs Kubernetes 1.34 or later"):
        render(chart, DRA, cluster_at("1.33.0"))
    assert render(chart, FULL, cluster_at("1.33.0")).objects  # without dra: fine


def test_the_webhook_keeps_a_passthrough_claim_katas_at_pod_create_and_at_reservation(chart):
    """With DRA the webhook reads the claims a pod names (--dra-driver) and reviews every write
    of a claim's reservation that holds the driver's devices, fail closed whatever the pods'
    failurePolicy; without DRA neither."""
    rendered = render(chart, merged(DRA, {"isolation": {"webhook": {"failurePolicy": "Ignore"}}}))
    args = rendered.get("Deployment", "-webhook")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--dra-")] == [
        f"--dra-driver={DRIVER}", f"--dra-device-class=gpu.{DRIVER}", f"--dra-device-class=nvswitch.{DRIVER}"]
    pods_hook, claims_hook = rendered.get("ValidatingWebhookConfiguration", "-webhook")["webhooks"]
    assert pods_hook["failurePolicy"] == "Ignore"
    assert claims_hook["name"] == "claims.isolation.kata-sandbox-manager.io"
    assert claims_hook["failurePolicy"] == "Fail"
    assert claims_hook["clientConfig"] == {**pods_hook["clientConfig"]}
    # kube-scheduler's PreBind writes the allocation and reservedFor through the status
    # subresource (an UPDATE); in every namespace.
    assert claims_hook["rules"] == [{"apiGroups": ["resource.k8s.io"], "apiVersions": ["v1"],
                                     "operations": ["UPDATE"], "resources": ["resourceclaims/status"],
                                     "scope": "Namespaced"}]
    assert "namespaceSelector" not in claims_hook and "objectSelector" not in claims_hook
    (condition,) = claims_hook["matchConditions"]
    assert condition["expression"].endswith(f"object.status.allocation.devices.results.exists(r, r.driver == "
                                            f"'{DRIVER}')")
    off = render(chart, FULL)
    assert len(off.get("ValidatingWebhookConfiguration", "-webhook")["webhooks"]) == 1
    assert not [a for a in off.get("Deployment", "-webhook")["spec"]["template"]["spec"]["containers"][0]["args"]
                if a.startswith("--dra-")]


def _evaluate(policy: dict, pod: dict, param: dict) -> str | None:
    """A ValidatingAdmissionPolicy on a pod with one param, as the API server runs it (its
    matchConditions, variables, then the first failing validation's message); cel-python."""
    celpy = pytest.importorskip("celpy")
    from celpy import celtypes, json_to_cel

    env, variables = celpy.Environment(), {}
    activation = {"object": json_to_cel(pod), "params": json_to_cel(param),
                  "request": json_to_cel({"operation": "CREATE"})}

    def run(expression: str):
        activation["variables"] = celtypes.MapType(variables)
        return env.program(env.compile(expression)).evaluate(activation)

    if not all(bool(run(c["expression"])) for c in policy["spec"].get("matchConditions", [])):
        return None
    for var in policy["spec"]["variables"]:
        variables[celtypes.StringType(var["name"])] = run(var["expression"])
    for check in policy["spec"]["validations"]:
        if not bool(run(check["expression"])):
            return str(run(check["messageExpression"]))
    return None


def test_the_admission_policy_refuses_a_passthrough_claim_outside_kata_as_the_webhook_does(chart):
    """With the webhook off, the policies (one per param kind: every claim, every template of
    the pod's namespace) give the webhook's answer at a pod's create, the class judged by name
    (as the webhook without --check-handlers: a policy cannot also read the RuntimeClass)."""
    from support import podkit

    from katamgr.admission.draclaims import DraChecks, pod_problem
    from katamgr.admission.rules import Policy

    rendered = render(chart, merged(DRA, {"isolation": {"webhook": {"enabled": False}}}))
    claims = rendered.get("ValidatingAdmissionPolicy", "-dra-claims-need-kata")
    templates = rendered.get("ValidatingAdmissionPolicy", "-dra-templates-need-kata")
    for suffix in ("-dra-claims-need-kata", "-dra-templates-need-kata"):
        binding = rendered.get("ValidatingAdmissionPolicyBinding", suffix)
        # No namespace: the params of the pod's own namespace (ParamRef, admissionregistration/v1).
        assert binding["spec"]["paramRef"] == {"selector": {}, "parameterNotFoundAction": "Allow"}
        assert binding["spec"]["validationActions"] == ["Deny"]
    ours = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": f"gpu.{DRIVER}"}}]}}
    fallback = {"devices": {"requests": [{"name": "gpu", "firstAvailable": [
        {"name": "c", "deviceClassName": "gpu.nvidia.com"}, {"name": "vm", "deviceClassName": f"nvswitch.{DRIVER}"}]}]}}
    theirs = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}}
    held = {"spec": theirs, "status": {"allocation": {"devices": {"results": [{"driver": DRIVER}]}}}}
    params = {"claim": {"metadata": {"name": "claim"}, "spec": ours},
              "fallback": {"metadata": {"name": "fallback"}, "spec": fallback},
              "theirs": {"metadata": {"name": "theirs"}, "spec": theirs},
              "held": {"metadata": {"name": "held"}, **held}}
    templates_of = {n: {"metadata": {"name": n}, "spec": {"spec": p["spec"]}} for n, p in params.items() if n != "held"}
    checks = DraChecks(DRIVER, (f"gpu.{DRIVER}", f"nvswitch.{DRIVER}"), lambda ns, n: params.get(n),
                       lambda ns, n: templates_of.get(n), lambda ns, n: None)
    policy = Policy(dra=checks)
    for runtime_class in (None, "runc", podkit.KATA, "kata-qemu-nvidia-gpu-tdx-runtime-rs", "kata"):
        for field, pool, policy_obj in (("resourceClaimName", params, claims),
                                        ("resourceClaimTemplateName", templates_of, templates)):
            for name, param in pool.items():
                pod = podkit.pod(podkit.container(claims=["gpu"]), runtime_class=runtime_class)
                pod["spec"]["resourceClaims"] = [{"name": "gpu", field: name}]
                webhook = pod_problem(pod, "default", policy, checks)
                said = _evaluate(policy_obj, pod, param)
                assert said == (webhook.removeprefix('pod "demo": ') if webhook else None), (
                    runtime_class, field, name)
                # The param names another claim: not this pod's, never judged.
                assert _evaluate(policy_obj, pod, {**param, "metadata": {"name": "other"}}) is None
    assert "no runtimeClassName (runc)" in _evaluate(claims, {
        "spec": {"containers": [], "resourceClaims": [{"name": "gpu", "resourceClaimName": "held"}]}}, params["held"])
    # Without DRA, or without the policy, none of them.
    for values in (FULL, merged(DRA, {"isolation": {"admissionPolicy": {"enabled": False}}})):
        assert render(chart, values).find("ValidatingAdmissionPolicy", "-dra-claims-need-kata") is None
