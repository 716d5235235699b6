"""The sandbox agent's DaemonSet (sandbox-daemonset.yaml): the kata-manager and
sandbox-device-plugin containers, their privileges and host mounts as the components are
switched, the OCI layout mounts of air-gapped sites, and the arguments katamgr is given."""

from __future__ import annotations

from typing import Any

import pytest
from chartvalues import AIR_GAPPED, AIR_GAPPED_CONFIG, CUSTOM_CLASSES, NODE_ARGS, VALUE_SETS
from support.chartkit import (
    FULL,
    RELEASE,
    Rendered,
    container,
    container_names,
    env_names,
    host_mounts,
    merged,
    render,
    rules,
)

# --- sandbox workloads on --------------------------------------------------------------

@pytest.mark.integration
def test_full_sandbox_agent_has_exactly_the_host_mounts_it_needs(chart):
    rendered = render(chart, FULL)
    assert container_names(rendered, "-sandbox-agent") == ["kata-manager", "sandbox-device-plugin"]

    agent = container(rendered, "-sandbox-agent", "kata-manager")
    assert agent["command"] == ["katamgr"]
    assert agent["args"] == ["run", "--config", "/etc/kata-sandbox-manager/config.yaml", *NODE_ARGS,
                             "--metrics-address", "0.0.0.0:9410",
                             # Helm owns the RuntimeClasses (test_runtimeclasses.py).
                             "--no-runtime-classes",
                             # The plugin beside it: offered only while the kubelet can give its devices.
                             "--offer-gate"]
    assert set(env_names(agent)) >= {"NODE_NAME", "POD_NAMESPACE"}
    assert agent["securityContext"]["privileged"] is True
    assert host_mounts(rendered, "-sandbox-agent", "kata-manager") == {
        "/host/sys": ("/sys", False),
        "/host/proc": ("/proc", True),
        "/host/dev/vfio": ("/dev/vfio", True),
        "/host/lib/modules": ("/lib/modules", True),
        # Which GPUs the kubelet gave pods (PodResources): kept on a switch away from passthrough.
        "/host/var/lib/kubelet/pod-resources": ("/var/lib/kubelet/pod-resources", True),
        "/host/etc/containerd": ("/etc/containerd", False),
        # kata-deploy's install: its release found, katamgr's GPU drop-in beside its config.
        "/host/opt/kata": ("/opt/kata", False),
        "/host/run/containerd": ("/run/containerd", False),
        "/host/opt/nvidia-gpu-operator/artifacts/runtimeclasses":
            ("/opt/nvidia-gpu-operator/artifacts/runtimeclasses", False),
        "/host/var/run/cdi": ("/var/run/cdi", False),
        "/host/run/nvidia/validations": ("/run/nvidia/validations", False),
        "/host/var/lib/kata-sandbox-manager": ("/var/lib/kata-sandbox-manager", False),
        # A split node's sides (gpunode.policy.splitnode), which both plugins list from.
        "/host/run/kata-sandbox-manager": ("/run/kata-sandbox-manager", False),
        # The offer gate hears the kubelet and the plugin restart (agent.kubeletwatch).
        "/host/var/lib/kubelet/device-plugins": ("/var/lib/kubelet/device-plugins", True),
    }
    config_mount = next(m for m in agent["volumeMounts"] if m["name"] == "config")
    assert config_mount["mountPath"] == "/etc/kata-sandbox-manager"

    plugin = container(rendered, "-sandbox-agent", "sandbox-device-plugin")
    # It follows the node's labels like katamgr and serves vm-passthrough nodes only.
    assert plugin["args"] == ["--workload", "auto", "--auto-modes", "vm-passthrough", *NODE_ARGS,
                              "--metrics-address", "0.0.0.0:9411",
                              "--containerd-config", "/etc/containerd/config.toml",
                              # It serves on until katamgr has withdrawn the offers (--offer-gate).
                              "--stop-grace", "15"]
    assert plugin["securityContext"]["privileged"] is False
    assert plugin["securityContext"]["allowPrivilegeEscalation"] is False
    assert host_mounts(rendered, "-sandbox-agent", "sandbox-device-plugin") == {
        "/host/var/lib/kubelet/device-plugins": ("/var/lib/kubelet/device-plugins", False),
        "/host/var/lib/kubelet/pod-resources": ("/var/lib/kubelet/pod-resources", True),
        "/host/sys": ("/sys", True),
        "/host/dev/vfio": ("/dev/vfio", True),
        "/host/var/run/cdi": ("/var/run/cdi", True),
        # The agent's hand-back verdicts (gpunode.host.handback): a GPU that failed stays Unhealthy.
        "/host/var/lib/kata-sandbox-manager/handback": ("/var/lib/kata-sandbox-manager/handback", True),
        # The node's Kata, read-only: the release that decides is the agent's (--containerd-config).
        "/host/etc/containerd": ("/etc/containerd", True),
        "/host/opt/kata": ("/opt/kata", True),
        # The sides katamgr publishes on a split node: the plugin lists only the VM side.
        "/host/run/kata-sandbox-manager": ("/run/kata-sandbox-manager", True),
    }

    pod = rendered.get("DaemonSet", "-sandbox-agent")["spec"]["template"]["spec"]
    # SIGHUP to containerd in the host PID namespace; its PID comes from its socket
    # (SO_PEERCRED), so the pod keeps its own network namespace.
    assert pod["hostPID"] is True
    assert "hostNetwork" not in pod and "dnsPolicy" not in pod
    # The pod's own identity (test_rbac.py), with the token its containers call the API with.
    assert pod["serviceAccountName"] == RELEASE + "-sandbox-agent"
    assert "automountServiceAccountToken" not in pod


@pytest.mark.integration
def test_a_changed_config_rolls_the_agent_pods(chart):
    def checksum(values):
        ds = render(chart, values).get("DaemonSet", "-sandbox-agent")
        return ds["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    assert checksum(FULL) == checksum(FULL)
    assert checksum(FULL) != checksum(CUSTOM_CLASSES)
    assert checksum(FULL) != checksum(merged(FULL, {"containerd": {"restartMode": "none"}}))


# --- components switched off, and their options ----------------------------------------

@pytest.mark.integration
def test_kata_manager_off_drops_runtime_class_rights_and_containerd_mounts(chart):
    rendered = render(chart, VALUE_SETS["kata-off"])
    agent = container(rendered, "-sandbox-agent", "kata-manager")
    assert agent["args"][-1:] == ["--no-kata"]
    mounts = host_mounts(rendered, "-sandbox-agent", "kata-manager")
    assert "/host/run/containerd" not in mounts
    # Where the node's Kata is found (its release decides NVSwitches): read only, nothing written.
    assert mounts["/host/etc/containerd"] == ("/etc/containerd", True)
    assert mounts["/host/opt/kata"] == ("/opt/kata", True)
    assert not any("artifacts" in path for path in mounts)
    assert set(rules(rendered.get("ClusterRole", "-sandbox-agent"))) == {"nodes", "nodes/status"}  # its labels, and its Sandbox* conditions
    assert set(rules(rendered.get("Role", "-sandbox-agent-node-events"))) == {"events"}
    assert rendered.find("Role", "-sandbox-agent") is None  # no pull secrets to read
    pod = rendered.get("DaemonSet", "-sandbox-agent")["spec"]["template"]["spec"]
    assert not pod.get("hostPID") and not pod.get("hostNetwork")
    # Binding still checks for processes holding the GPUs.
    assert mounts["/host/proc"] == ("/proc", True)


@pytest.mark.integration
def test_vfio_manager_off_agent_is_not_privileged(chart):
    rendered = render(chart, VALUE_SETS["vfio-off"])
    agent = container(rendered, "-sandbox-agent", "kata-manager")
    assert "--no-vfio" in agent["args"]
    assert "--no-kata" not in agent["args"] and "--no-cdi" not in agent["args"]
    security = agent["securityContext"]
    assert security["privileged"] is False
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    mounts = host_mounts(rendered, "-sandbox-agent", "kata-manager")
    assert mounts["/host/sys"] == ("/sys", True)
    assert "/host/lib/modules" not in mounts
    # Only what finding containerd's PID needs (restartMode signal).
    assert security["capabilities"]["add"] == ["SYS_PTRACE"]
    assert mounts["/host/proc"] == ("/proc", True)
    template = rendered.get("DaemonSet", "-sandbox-agent")["spec"]["template"]
    assert template["metadata"]["annotations"][
        "container.apparmor.security.beta.kubernetes.io/kata-manager"] == "unconfined"

    quiet = render(chart, merged(VALUE_SETS["vfio-off"], {"containerd": {"restartMode": "none"}}))
    agent = container(quiet, "-sandbox-agent", "kata-manager")
    assert "add" not in agent["securityContext"]["capabilities"]
    assert "/host/proc" not in host_mounts(quiet, "-sandbox-agent", "kata-manager")
    template = quiet.get("DaemonSet", "-sandbox-agent")["spec"]["template"]
    assert not any("apparmor" in key for key in template["metadata"]["annotations"])
    assert not template["spec"].get("hostPID") and not template["spec"].get("hostNetwork")


@pytest.mark.integration
def test_cdi_off_passes_no_cdi_and_mounts_no_cdi_dir(chart):
    rendered = render(chart, merged(FULL, {"cdi": {"enabled": False}}))
    assert container(rendered, "-sandbox-agent", "kata-manager")["args"][-1] == "--no-cdi"
    for name in ("kata-manager", "sandbox-device-plugin"):
        assert "/host/var/run/cdi" not in host_mounts(rendered, "-sandbox-agent", name)


@pytest.mark.integration
def test_alias_restart_mode_and_runtime_class_options(chart):
    rendered = render(chart, VALUE_SETS["alias-no-restart"])
    plugin = container(rendered, "-sandbox-agent", "sandbox-device-plugin")
    args = plugin["args"]
    assert args[args.index("--alias") + 1] == "pgpu"
    # restartMode none: nothing to signal, so neither host PID nor host network namespace.
    pod = rendered.get("DaemonSet", "-sandbox-agent")["spec"]["template"]["spec"]
    assert not pod.get("hostPID") and not pod.get("hostNetwork")
    fallback = rendered.get("DaemonSet", "-device-plugin")["spec"]["template"]["spec"]
    assert fallback["runtimeClassName"] == "nvidia"


# --- air-gapped: OCI image layouts copied onto the nodes -------------------------------

def layout_mounts(rendered: Rendered) -> dict[str, tuple[str, bool]]:
    ds = rendered.find("DaemonSet", "-sandbox-agent")
    if ds is None:
        return {}
    names = {m["mountPath"]: m["name"]
             for m in container(rendered, "-sandbox-agent", "kata-manager")["volumeMounts"]}
    return {path: where for path, where in host_mounts(rendered, "-sandbox-agent", "kata-manager").items()
            if names[path].startswith("oci-layout-")}


def with_layouts(urls: list[str], dirs: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    classes = [{"name": f"kata-{i}", "artifacts": {"url": url}} for i, url in enumerate(urls)]
    kata: dict[str, Any] = {"config": {"runtimeClasses": classes}}
    if dirs is not None:
        kata["ociLayoutDirs"] = dirs
    return merged(FULL, {"kataManager": kata}, extra)


@pytest.mark.integration
def test_air_gapped_layouts_are_mounted_read_only_where_katamgr_reads_them(chart):
    from gpunode.host.root import HostRoot
    from katamgr.artifacts.refs import LayoutRef, parse_ref

    rendered = render(chart, VALUE_SETS["air-gapped"])
    mounts = layout_mounts(rendered)
    in_container = HostRoot.at("/host")  # the agent's --host-root
    for rc in AIR_GAPPED_CONFIG["runtimeClasses"]:
        ref = parse_ref(rc["artifacts"]["url"])
        assert isinstance(ref, LayoutRef)
        assert mounts[str(in_container.path(ref.path))] == (str(ref.path), True)
    # Both classes share one layout (different tags): mounted once, plus the listed dir.
    assert mounts == {
        "/host/var/lib/kata-artifacts/kata-gpu-artifacts": ("/var/lib/kata-artifacts/kata-gpu-artifacts", True),
        "/host/srv/kata-layouts": ("/srv/kata-layouts", True),
    }
    # The example values file serves the same layout.
    example = render(chart, VALUE_SETS["example-air-gapped"])
    assert layout_mounts(example) == {
        "/host/var/lib/kata-artifacts/kata-gpu-artifacts": ("/var/lib/kata-artifacts/kata-gpu-artifacts", True),
    }
    assert {c["image"].rsplit(":", 1)[0] for _, c in example.containers()} == {
        "registry.local:5000/kata-sandbox-manager/kata-sandbox-manager"}
    # The device plugin never reads artifacts.
    plugin = host_mounts(rendered, "-sandbox-agent", "sandbox-device-plugin")
    assert not any("artifacts" in path or "layouts" in path for path in plugin)


@pytest.mark.parametrize(("values", "expected"), [
    (with_layouts(["oci-layout:///opt/layouts/a@sha256:" + "0" * 64, "oci-layout:///opt/layouts/a:v2",
                   "oci-layout:///opt/layouts/b", "registry.local/kata:1"],
                  dirs=["/opt/layouts/a/"], hostPaths={"rootFS": "/node/"}),
     {"/host/opt/layouts/a": ("/node/opt/layouts/a", True),
      "/host/opt/layouts/b": ("/node/opt/layouts/b", True)}),
    (with_layouts(["oci-layout:///opt/layouts/a:v1", "oci-layout:///opt/layouts/b/c:v1"],
                  dirs=["/opt/layouts"]),
     {"/host/opt/layouts": ("/opt/layouts", True)}),
    # Below the artifacts dir the layout is reachable already (through a writable mount).
    (with_layouts(["oci-layout:///opt/nvidia-gpu-operator/artifacts/runtimeclasses/layout:v1",
                   "oci-layout:///opt/nvidia-gpu-operator/artifacts/runtimeclasses"]), {}),
    (with_layouts(["registry.local/kata:1"]), {}),
    (merged(AIR_GAPPED, {"kataManager": {"enabled": False, "ociLayoutDirs": ["/srv/kata-layouts"]}}), {}),
], ids=["digest-tag-untagged-root-fs", "listed-parent-covers-urls", "under-artifacts-dir",
        "registry-only", "kata-off"])
@pytest.mark.integration
def test_each_layout_dir_is_mounted_once(chart, values, expected):
    rendered = render(chart, values)
    assert layout_mounts(rendered) == expected
    agent = container(rendered, "-sandbox-agent", "kata-manager")
    paths = [m["mountPath"] for m in agent["volumeMounts"]]
    assert len(paths) == len(set(paths)), paths


@pytest.mark.parametrize("url", ["oci-layout://layouts/kata:v1", "oci-layout:///opt/../etc/kata:v1",
                                 "oci-layout://:v1"])
@pytest.mark.integration
def test_a_layout_url_that_is_no_absolute_host_path_is_refused(helm, chart, url):
    with pytest.raises(helm.HelmError) as caught:
        render(chart, with_layouts(["registry.local/kata:1", url]))
    message = str(caught.value)
    assert "kataManager.config.runtimeClasses[1].artifacts.url" in message, message
    assert url in message and "absolute" in message, message


# --- katamgr accepts the arguments the chart passes ------------------------------------

# A missing Helm engine fails this under REQUIRE_INTEGRATION through the helm fixture.

def _subcommands(parser) -> dict:
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


@pytest.mark.parametrize("values", [FULL, VALUE_SETS["vfio-off"], VALUE_SETS["kata-off"],
                                    merged(FULL, {"cdi": {"enabled": False}}),
                                    VALUE_SETS["tolerations-rootfs-vm-default"],
                                    merged(FULL, {"kataManager": {"planOnly": True}})],
                         ids=["full", "vfio-off", "kata-off", "cdi-off", "default-vm-passthrough",
                              "plan-only"])
def test_katamgr_understands_the_agent_arguments(chart, values):
    from katamgr import cli

    parser = cli.build_parser()
    assert "run" in _subcommands(parser)
    args = container(render(chart, values), "-sandbox-agent", "kata-manager")["args"]
    parsed = parser.parse_args(args)  # argparse exits (fails the test) on an unknown flag
    assert parsed.command == "run"
    # An unlabeled node is scheduled as sandboxWorkloads.defaultWorkload; katamgr must
    # treat it the same, or it binds nothing on the nodes the agent was placed on.
    default = chart.merge_values(values)["sandboxWorkloads"]["defaultWorkload"]
    assert parsed.default_workload == default
    assert parsed.workload == "auto"
    assert parsed.no_kata == (not chart.merge_values(values)["kataManager"]["enabled"])


@pytest.mark.integration
def test_runtime_root_follows_the_host_root_fs(chart):
    """CDI specs and Allocate answers name device nodes as containerd opens them: below
    hostPaths.rootFS when the node's / is elsewhere (the local node of tests/node)."""
    from katamgr.cli import build_parser
    from sandbox_plugin.cli import parse_args

    for name, parse in (("kata-manager", lambda a: build_parser().parse_args(a)),
                        ("sandbox-device-plugin", parse_args)):
        moved = container(render(chart, merged(FULL, {"hostPaths": {"rootFS": "/node/"}})),
                          "-sandbox-agent", name)
        at = moved["args"].index("--runtime-root")
        assert moved["args"][at + 1] == "/node/"  # the value as written, normalised by the option
        assert parse(moved["args"]).runtime_root == "/node"
        default = container(render(chart, FULL), "-sandbox-agent", name)["args"]
        assert default[default.index("--runtime-root") + 1] == "/"  # the node's / is containerd's
