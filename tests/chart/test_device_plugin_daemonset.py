"""The container GPU plugin's DaemonSet (device-plugin-daemonset.yaml), and the arguments
every sandbox-device-plugin container is given."""

from __future__ import annotations

import pytest
from support.chartkit import FULL, RELEASE, container, env_names, host_mounts, merged, render

# --- defaults: like the GPU Operator, sandbox workloads are off ------------------------

@pytest.mark.integration
def test_defaults_run_only_the_container_gpu_plugin_unprivileged(chart):
    rendered = render(chart, {})
    # Besides the isolation objects (on by default: test_isolation.py), only the plugin.
    isolation = {"webhook", "admission-policy"}
    assert [(kind, name) for kind, name in rendered.kinds()
            if rendered.find(kind, name[len(RELEASE):])["metadata"]["labels"].get(
                "app.kubernetes.io/component") not in isolation] == [
        ("DaemonSet", f"{RELEASE}-device-plugin"), ("Service", f"{RELEASE}-device-plugin-metrics"),
        ("ServiceAccount", f"{RELEASE}-device-plugin"),
    ]
    plugin = container(rendered, "-device-plugin", "device-plugin")
    assert plugin["command"] == ["sandbox-device-plugin"]
    assert plugin["args"] == ["--host-root", "/host", "--kubelet-dir", "/var/lib/kubelet", "--workload", "container",
                              "--node-name", "$(NODE_NAME)", "--log-format", "text",
                              "--metrics-address", "0.0.0.0:9411"]
    assert env_names(plugin)["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env_names(plugin)["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert plugin["securityContext"]["privileged"] is False
    assert plugin["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert host_mounts(rendered, "-device-plugin", "device-plugin") == {
        "/host/var/lib/kubelet/device-plugins": ("/var/lib/kubelet/device-plugins", False),
        "/host/var/lib/kubelet/pod-resources": ("/var/lib/kubelet/pod-resources", True),
        # NUMA nodes for the kubelet's topology hints (the real kubelet's node showed the
        # plugin reading sysfs through no mount at all).
        "/host/sys": ("/sys", True),
    }
    pod = rendered.get("DaemonSet", "-device-plugin")["spec"]["template"]["spec"]
    assert not pod.get("hostPID")
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    # --workload container calls no API (sandbox_plugin.cli: only --workload auto reads the Node):
    # its own ServiceAccount, bound to no role, and no token in the pod.
    assert pod["serviceAccountName"] == f"{RELEASE}-device-plugin"
    assert pod["automountServiceAccountToken"] is False
    assert rendered.get("ServiceAccount", "-device-plugin")["automountServiceAccountToken"] is False
    assert not [b for b in rendered.objects if b["kind"] in ("RoleBinding", "ClusterRoleBinding")
                and any(s["name"] == f"{RELEASE}-device-plugin" for s in b["subjects"])]


# --- the device plugin accepts the arguments the chart passes --------------------------

# A missing Helm engine fails this under REQUIRE_INTEGRATION through the helm fixture.

@pytest.mark.parametrize("values", [{}, merged(FULL, {"sandboxDevicePlugin": {"alias": "pgpu"}})],
                         ids=["container", "vm-passthrough-alias"])
def test_device_plugin_understands_its_arguments(chart, values):
    from sandbox_plugin import cli

    rendered = render(chart, values)
    for _, c in rendered.containers():
        if c["command"] == ["sandbox-device-plugin"]:
            args = [a.replace("$(NODE_NAME)", "gpu-node-1") for a in c["args"]]
            cli.build_parser().parse_args(args)


# --- split nodes: the container share is the container plugin's --------------------------

@pytest.mark.integration
def test_where_the_agent_splits_nodes_the_container_plugin_follows_its_node_and_reads_the_sides(chart):
    rendered = render(chart, FULL)
    plugin = container(rendered, "-device-plugin", "device-plugin")
    assert plugin["args"][4:12] == ["--workload", "auto", "--auto-modes", "container",
                                    "--default-workload", "container", "--node-name", "$(NODE_NAME)"]
    # The sides katamgr publishes (gpunode.policy.splitnode.SIDES_FILE), read-only.
    assert host_mounts(rendered, "-device-plugin", "device-plugin")["/host/run/kata-sandbox-manager"] == (
        "/run/kata-sandbox-manager", True)
    pod = rendered.get("DaemonSet", "-device-plugin")["spec"]["template"]["spec"]
    assert "automountServiceAccountToken" not in pod  # it reads its Node's labels (test_rbac.py)
    workload = [e for term in pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"] for e in term["matchExpressions"] if e["key"] == "nvidia.com/gpu.workload.config"]
    assert workload == [{"key": "nvidia.com/gpu.workload.config", "operator": "NotIn", "values": ["vm-vgpu"]}]


@pytest.mark.integration
def test_the_two_plugins_never_serve_one_node_state_alike(chart):
    """Each plugin's --auto-modes as rendered, through the plugins' own rule (follow.mode_for):
    on each node state at most one serves a mode, and on a split node the container plugin
    serves the container side while the sandbox agent's serves the VM side (disjoint sides:
    gpunode.policy.splitnode, tests/plugin/test_split_overlap.py)."""
    from gpunode.policy.workload import Resolution, Workload
    from sandbox_plugin import cli
    from sandbox_plugin.follow import mode_for
    from sandbox_plugin.manager import Mode

    rendered = render(chart, FULL)
    modes = {}
    for name, c in (("container", container(rendered, "-device-plugin", "device-plugin")),
                    ("sandbox", container(rendered, "-sandbox-agent", "sandbox-device-plugin"))):
        args = cli.build_parser().parse_args([a.replace("$(NODE_NAME)", "gpu-node-1") for a in c["args"]])
        modes[name] = args.auto_modes
    for workload, split, want in ((Workload.CONTAINER, False, {"container": Mode.CONTAINER}),
                                  (Workload.VM_PASSTHROUGH, False, {"sandbox": Mode.VM_PASSTHROUGH}),
                                  (Workload.VM_PASSTHROUGH, True, {"container": Mode.CONTAINER,
                                                                   "sandbox": Mode.VM_PASSTHROUGH})):
        served = {name: mode_for(Resolution(workload, "labeled"), m, split=split)[0] for name, m in modes.items()}
        assert {k: v for k, v in served.items() if v is not None} == want, (workload, split)
