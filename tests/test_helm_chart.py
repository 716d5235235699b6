"""The Helm chart, rendered and linted by the real Helm v4 engine (helm-python-sdk).

Every rendered object is checked against the Kubernetes API schemas shipped inside
kubernetes-validate (offline), for the default values and a table of value sets.
GPU Operator values carried over, the image block and resource naming are in
test_helm_values.py, which shares the plumbing below.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from conftest import EXAMPLES, REPO, REQUIRE_INTEGRATION

CHART = REPO / "deploy" / "helm" / "kata-sandbox-manager"
RELEASE = "kata-sandbox-manager"
NAMESPACE = "gpu-sandbox"
# The oldest Kubernetes the chart claims (Chart.yaml kubeVersion) and a current one.
KUBE_VERSIONS = ("1.25.0", "1.33.0")

SANDBOX = {"sandboxWorkloads": {"enabled": True}}
# cdi.enabled is true by default (as in the GPU Operator); FULL still says so explicitly.
FULL = {
    "sandboxWorkloads": {"enabled": True},
    "kataManager": {"enabled": True},
    "cdi": {"enabled": True},
}


def merged(*parts: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge value dicts left to right (later wins), like repeated --values."""
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merged(out[key], value)
            else:
                out[key] = value
    return out


CUSTOM_CLASSES = merged(FULL, {
    "kataManager": {"config": {
        "artifactsDir": "/var/lib/kata-artifacts",
        "runtimeClasses": [
            {"name": "kata-gpu", "artifacts": {"url": "registry.local/kata:1", "pullSecret": "mirror"}},
            {"name": "kata-gpu-cc", "nodeSelector": {"nvidia.com/cc.capable": "true"},
             "artifacts": {"url": "registry.local/kata:1-snp", "pullSecret": "mirror"}},
            {"name": "kata-gpu-test", "artifacts": {"url": "registry.local/kata:test", "pullSecret": "lab"}},
        ],
        "runtimeClassOverhead": {"podFixed": {"memory": "160Mi", "cpu": "250m"}},
        "insecureRegistries": ["registry.local:5000"],
    }, "imagePullSecrets": ["ghcr-creds"]},
})

# The air-gapped config shape: artifacts from OCI image layouts copied onto the nodes.
AIR_GAPPED_CONFIG = yaml.safe_load((EXAMPLES / "configs" / "air-gapped.yaml").read_text())
AIR_GAPPED = merged(FULL, {"kataManager": {"config": {
    "artifactsDir": AIR_GAPPED_CONFIG["artifactsDir"],
    "runtimeClasses": AIR_GAPPED_CONFIG["runtimeClasses"],
}}})

TOLERATIONS = [
    {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"},
    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
]

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "sandbox": SANDBOX,
    "sandbox-kata-cdi": FULL,
    "kata-off": merged(FULL, {"kataManager": {"enabled": False}}),
    "vfio-off": merged(FULL, {"vfioManager": {"enabled": False}}),
    "custom-classes": CUSTOM_CLASSES,
    "tolerations-rootfs-vm-default": merged(FULL, {
        "sandboxWorkloads": {"defaultWorkload": "vm-passthrough"},
        "daemonsets": {"tolerations": TOLERATIONS, "updateStrategy": "OnDelete"},
        "hostPaths": {"rootFS": "/node/"},
    }),
    "alias-no-restart": merged(FULL, {
        "sandboxDevicePlugin": {"alias": "pgpu"},
        "containerd": {"restartMode": "none"},
        "devicePlugin": {"runtimeClassName": "nvidia"},
    }),
    "vfio-off-no-restart": merged(FULL, {"vfioManager": {"enabled": False},
                                         "containerd": {"restartMode": "none"}}),
    "plugin-only-annotated": merged(SANDBOX, {"vfioManager": {"enabled": False},
                                              "cdi": {"enabled": False},
                                              "daemonsets": {"annotations": {"team": "gpu"},
                                                             "labels": {"tier": "node"}}}),
    "agent-only": merged(FULL, {"sandboxDevicePlugin": {"enabled": False},
                                "devicePlugin": {"enabled": False}}),
    "sandbox-nothing-enabled": merged(SANDBOX, {"vfioManager": {"enabled": False},
                                                "cdi": {"enabled": False},
                                                "sandboxDevicePlugin": {"enabled": False}}),
    "air-gapped": merged(AIR_GAPPED, {"kataManager": {"ociLayoutDirs": ["/srv/kata-layouts"]}}),
    "example-mixed-cluster": yaml.safe_load((EXAMPLES / "values" / "mixed-cluster.yaml").read_text()),
    "example-air-gapped": yaml.safe_load((EXAMPLES / "values" / "air-gapped.yaml").read_text()),
    "example-gpu-operator": yaml.safe_load((EXAMPLES / "values" / "gpu-operator.yaml").read_text()),
    # What the GPU Operator's users switch on: CDI comes from its default.
    "sandbox-kata-default-cdi": {"sandboxWorkloads": {"enabled": True}, "kataManager": {"enabled": True}},
}


# --- the real Helm engine ---------------------------------------------------------------

def load_helm():
    """helm_python, or skip (fail under REQUIRE_INTEGRATION=1) when it cannot load."""
    try:
        import helm_python
    except ImportError as exc:
        _missing(f"helm-python-sdk is not installed ({exc}); run: pip install helm-python-sdk")
    try:
        helm_python.helm_sdk_version()  # loads the embedded Helm engine (libhelm_c)
    except (helm_python.HelmError, OSError) as exc:
        _missing(f"helm-python-sdk cannot load its Helm engine: {exc}")
    return helm_python


@pytest.fixture(scope="module")
def helm():
    return load_helm()


@pytest.fixture(scope="module")
def kube_validate():
    try:
        import kubernetes_validate
    except ImportError as exc:
        _missing(f"kubernetes-validate is not installed ({exc}); run: pip install kubernetes-validate")
    return kubernetes_validate


def _missing(message: str) -> None:
    if REQUIRE_INTEGRATION:
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def chart(helm):
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@dataclass(frozen=True)
class Rendered:
    objects: list[dict[str, Any]]

    def kinds(self) -> list[tuple[str, str]]:
        return sorted((o["kind"], o["metadata"]["name"]) for o in self.objects)

    def get(self, kind: str, suffix: str = "") -> dict[str, Any]:
        name = RELEASE + suffix
        found = [o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name]
        assert found, f"no {kind} {name} rendered; have {self.kinds()}"
        return found[0]

    def find(self, kind: str, suffix: str = "") -> dict[str, Any] | None:
        name = RELEASE + suffix
        return next((o for o in self.objects
                     if o["kind"] == kind and o["metadata"]["name"] == name), None)

    def daemonsets(self) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == "DaemonSet"]

    def containers(self) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        for ds in self.daemonsets():
            for container in ds["spec"]["template"]["spec"]["containers"]:
                yield ds, container


def render(chart, values: dict[str, Any]) -> Rendered:
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = [
        obj
        for path, text in sorted(manifests.items()) if path.endswith((".yaml", ".yml"))
        for obj in yaml.safe_load_all(text) if obj
    ]
    return Rendered(objects)


def container(rendered: Rendered, ds_suffix: str, name: str) -> dict[str, Any]:
    ds = rendered.get("DaemonSet", ds_suffix)
    for c in ds["spec"]["template"]["spec"]["containers"]:
        if c["name"] == name:
            return c
    raise AssertionError(f"DaemonSet {RELEASE}{ds_suffix} has no container {name}")


def container_names(rendered: Rendered, ds_suffix: str) -> list[str]:
    ds = rendered.get("DaemonSet", ds_suffix)
    return [c["name"] for c in ds["spec"]["template"]["spec"]["containers"]]


def host_mounts(rendered: Rendered, ds_suffix: str, name: str) -> dict[str, tuple[str, bool]]:
    """mountPath -> (host path, read-only) for every hostPath mount of a container."""
    ds = rendered.get("DaemonSet", ds_suffix)
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    out = {}
    for mount in container(rendered, ds_suffix, name).get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "hostPath" in volume:
            out[mount["mountPath"]] = (volume["hostPath"]["path"], bool(mount.get("readOnly")))
    return out


def rules(role: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """resource -> rule, for roles whose rules name one resource each."""
    return {rule["resources"][0]: rule for rule in role["rules"]}


def workload_match(ds: dict[str, Any], labels: dict[str, str]) -> bool:
    """Would the scheduler place this DaemonSet's pod on a node with these labels?

    Follows Kubernetes' nodeSelectorTerms semantics: terms are ORed, the expressions of
    a term ANDed; NotIn and DoesNotExist also match a node without the key.
    """
    spec = ds["spec"]["template"]["spec"]
    for key, value in spec.get("nodeSelector", {}).items():
        if labels.get(key) != value:
            return False
    terms = (spec.get("affinity", {}).get("nodeAffinity", {})
             .get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms"))
    if not terms:
        return True

    def matches(expr: dict[str, Any]) -> bool:
        op, key, values = expr["operator"], expr["key"], expr.get("values", [])
        if op == "In":
            return key in labels and labels[key] in values
        if op == "NotIn":
            return key not in labels or labels[key] not in values
        if op == "Exists":
            return key in labels
        if op == "DoesNotExist":
            return key not in labels
        raise AssertionError(f"operator {op} not handled")

    return any(all(matches(e) for e in term.get("matchExpressions", [])) for term in terms)


def env_names(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in c.get("env", [])}


# --- every value set: valid Kubernetes objects, clean lint ------------------------------

@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
@pytest.mark.integration
def test_every_rendered_object_is_valid_for_kubernetes(chart, kube_validate, values):
    rendered = render(chart, values)
    assert rendered.objects
    problems = []
    for version in KUBE_VERSIONS:
        for obj in rendered.objects:
            try:
                kube_validate.validate(obj, version, strict=True)
            except kube_validate.ValidationError as exc:
                where = "/".join(str(p) for p in exc.absolute_path)
                problems.append(f"{version} {obj['kind']}/{obj['metadata']['name']} at {where}: "
                                f"{exc.message}")
    assert not problems, "\n".join(problems)
    for obj in rendered.objects:
        if obj["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            assert "namespace" not in obj["metadata"]
        else:
            assert obj["metadata"]["namespace"] == NAMESPACE


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
@pytest.mark.integration
def test_every_mount_has_its_volume_and_every_volume_a_mount(chart, values):
    # What the API server checks beyond the JSON schema: names resolve and are unique.
    for ds in render(chart, values).daemonsets():
        pod = ds["spec"]["template"]["spec"]
        volumes = [v["name"] for v in pod.get("volumes", [])]
        assert len(volumes) == len(set(volumes)), volumes
        used = set()
        for c in pod["containers"]:
            mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
            assert len(mounts) == len(set(mounts)), mounts
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{c['name']} mounts undefined volume {m['name']}"
                used.add(m["name"])
        assert used == set(volumes), f"unused volumes {set(volumes) - used}"
        names = [c["name"] for c in pod["containers"]]
        assert len(names) == len(set(names))


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
@pytest.mark.integration
def test_helm_lint_is_clean(helm, values):
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    # Severity 1 is "info" (e.g. "icon is recommended"); anything above is a finding.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


# --- defaults: like the GPU Operator, sandbox workloads are off --------------------------

@pytest.mark.integration
def test_defaults_run_only_the_container_gpu_plugin_unprivileged(chart):
    rendered = render(chart, {})
    assert rendered.kinds() == [
        ("ClusterRole", RELEASE), ("ClusterRoleBinding", RELEASE),
        ("DaemonSet", f"{RELEASE}-device-plugin"), ("ServiceAccount", RELEASE),
    ]
    plugin = container(rendered, "-device-plugin", "device-plugin")
    assert plugin["command"] == ["sandbox-device-plugin"]
    assert plugin["args"] == ["--host-root", "/host", "--mode", "container",
                              "--node-name", "$(NODE_NAME)"]
    assert env_names(plugin)["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env_names(plugin)["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert plugin["securityContext"]["privileged"] is False
    assert plugin["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert host_mounts(rendered, "-device-plugin", "device-plugin") == {
        "/host/var/lib/kubelet/device-plugins": ("/var/lib/kubelet/device-plugins", False),
        "/host/var/lib/kubelet/pod-resources": ("/var/lib/kubelet/pod-resources", True),
    }
    pod = rendered.get("DaemonSet", "-device-plugin")["spec"]["template"]["spec"]
    assert not pod.get("hostPID")
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    # Read-only access to nodes, nothing else.
    assert rules(rendered.get("ClusterRole")) == {
        "nodes": {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
    }


@pytest.mark.integration
def test_image_tag_is_the_package_version(chart):
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    rendered = render(chart, FULL)
    images = {c["image"] for _, c in rendered.containers()}
    assert images == {f"ghcr.io/kata-sandbox-manager/kata-sandbox-manager:{version}"}
    # Both commands come from that one image: each is a console script of the package.
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert {c["command"][0] for _, c in rendered.containers()} == {"katamgr", "sandbox-device-plugin"}
    assert {c["command"][0] for _, c in rendered.containers()} <= set(scripts)
    pinned = render(chart, merged(FULL, {"image": {"tag": "0.2.0-rc1"}}))
    assert {c["image"].rsplit(":", 1)[1] for _, c in pinned.containers()} == {"0.2.0-rc1"}


# --- sandbox workloads on -------------------------------------------------------------

@pytest.mark.integration
def test_full_sandbox_agent_has_exactly_the_host_mounts_it_needs(chart):
    rendered = render(chart, FULL)
    assert container_names(rendered, "-sandbox-agent") == ["kata-manager", "sandbox-device-plugin"]

    agent = container(rendered, "-sandbox-agent", "kata-manager")
    assert agent["command"] == ["katamgr"]
    assert agent["args"] == ["run", "--config", "/etc/kata-sandbox-manager/config.yaml",
                             "--host-root", "/host", "--default-workload", "container",
                             "--resource-naming", "nvidia"]
    assert set(env_names(agent)) >= {"NODE_NAME", "POD_NAMESPACE"}
    assert agent["securityContext"]["privileged"] is True
    assert host_mounts(rendered, "-sandbox-agent", "kata-manager") == {
        "/host/sys": ("/sys", False),
        "/host/proc": ("/proc", True),
        "/host/dev/vfio": ("/dev/vfio", True),
        "/host/lib/modules": ("/lib/modules", True),
        "/host/etc/containerd": ("/etc/containerd", False),
        "/host/run/containerd": ("/run/containerd", False),
        "/host/opt/nvidia-gpu-operator/artifacts/runtimeclasses":
            ("/opt/nvidia-gpu-operator/artifacts/runtimeclasses", False),
        "/host/var/run/cdi": ("/var/run/cdi", False),
        "/host/run/nvidia/validations": ("/run/nvidia/validations", False),
        "/host/var/lib/kata-sandbox-manager": ("/var/lib/kata-sandbox-manager", False),
    }
    config_mount = next(m for m in agent["volumeMounts"] if m["name"] == "config")
    assert config_mount["mountPath"] == "/etc/kata-sandbox-manager"

    plugin = container(rendered, "-sandbox-agent", "sandbox-device-plugin")
    assert plugin["args"] == ["--host-root", "/host", "--mode", "vm-passthrough",
                              "--node-name", "$(NODE_NAME)", "--resource-naming", "nvidia"]
    assert plugin["securityContext"]["privileged"] is False
    assert plugin["securityContext"]["allowPrivilegeEscalation"] is False
    assert host_mounts(rendered, "-sandbox-agent", "sandbox-device-plugin") == {
        "/host/var/lib/kubelet/device-plugins": ("/var/lib/kubelet/device-plugins", False),
        "/host/var/lib/kubelet/pod-resources": ("/var/lib/kubelet/pod-resources", True),
        "/host/sys": ("/sys", True),
        "/host/dev/vfio": ("/dev/vfio", True),
        "/host/var/run/cdi": ("/var/run/cdi", True),
    }

    pod = rendered.get("DaemonSet", "-sandbox-agent")["spec"]["template"]["spec"]
    # SIGHUP to containerd, found by the socket it holds in the host network namespace.
    assert pod["hostPID"] is True
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["serviceAccountName"] == RELEASE


@pytest.mark.integration
def test_config_map_carries_the_kata_manager_config(chart):
    rendered = render(chart, CUSTOM_CLASSES)
    config = yaml.safe_load(rendered.get("ConfigMap", "-config")["data"]["config.yaml"])
    assert config == {
        "artifactsDir": "/var/lib/kata-artifacts",
        "runtimeClasses": CUSTOM_CLASSES["kataManager"]["config"]["runtimeClasses"],
        "containerd": {"configPath": "/etc/containerd/config.toml",
                       "socket": "/run/containerd/containerd.sock", "restartMode": "signal"},
        "runtimeClassOverhead": {"podFixed": {"memory": "160Mi", "cpu": "250m"}},
        "insecureRegistries": ["registry.local:5000"],
    }
    # Optional keys stay out of the file unless set.
    default = yaml.safe_load(render(chart, FULL).get("ConfigMap", "-config")["data"]["config.yaml"])
    assert set(default) == {"artifactsDir", "runtimeClasses", "containerd"}
    pod = rendered.get("DaemonSet", "-sandbox-agent")["spec"]["template"]["spec"]
    config_volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert config_volume["configMap"]["name"] == f"{RELEASE}-config"
    mounts = host_mounts(rendered, "-sandbox-agent", "kata-manager")
    assert mounts["/host/var/lib/kata-artifacts"] == ("/var/lib/kata-artifacts", False)
    assert not any("nvidia-gpu-operator" in path for path in mounts)
    assert pod["imagePullSecrets"] == [{"name": "ghcr-creds"}]


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
    from katamgr.artifacts.refs import LayoutRef, parse_ref
    from katamgr.host.root import HostRoot

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
    assert not any("kata" in path for path in plugin)


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


@pytest.mark.integration
def test_a_changed_config_rolls_the_agent_pods(chart):
    def checksum(values):
        ds = render(chart, values).get("DaemonSet", "-sandbox-agent")
        return ds["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    assert checksum(FULL) == checksum(FULL)
    assert checksum(FULL) != checksum(CUSTOM_CLASSES)
    assert checksum(FULL) != checksum(merged(FULL, {"containerd": {"restartMode": "none"}}))


@pytest.mark.integration
def test_rbac_is_least_privilege_for_the_full_agent(chart):
    rendered = render(chart, CUSTOM_CLASSES)
    cluster = rules(rendered.get("ClusterRole"))
    assert set(cluster) == {"nodes", "runtimeclasses"}
    assert cluster["nodes"]["verbs"] == ["get", "list", "watch"]  # nothing writes the Node
    assert cluster["runtimeclasses"]["apiGroups"] == ["node.k8s.io"]
    assert sorted(cluster["runtimeclasses"]["verbs"]) == sorted(
        ["get", "list", "watch", "create", "patch", "delete"])

    role = rendered.get("Role")
    assert role["metadata"]["namespace"] == NAMESPACE
    namespaced = rules(role)
    assert set(namespaced) == {"events", "secrets"}
    assert namespaced["events"]["verbs"] == ["create"]
    # Only the pull secrets the runtime classes name.
    assert namespaced["secrets"]["verbs"] == ["get"]
    assert sorted(namespaced["secrets"]["resourceNames"]) == ["lab", "mirror"]

    for binding_kind, role_kind in (("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")):
        binding = rendered.get(binding_kind)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                      "kind": role_kind, "name": RELEASE}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE,
                                        "namespace": NAMESPACE}]


@pytest.mark.integration
def test_no_pull_secret_no_secret_access(chart):
    rendered = render(chart, FULL)  # default runtime classes have pullSecret ""
    assert set(rules(rendered.get("Role"))) == {"events"}


@pytest.mark.integration
def test_kata_manager_off_drops_runtime_class_rights_and_containerd_mounts(chart):
    rendered = render(chart, VALUE_SETS["kata-off"])
    agent = container(rendered, "-sandbox-agent", "kata-manager")
    assert agent["args"][-1:] == ["--no-kata"]
    mounts = host_mounts(rendered, "-sandbox-agent", "kata-manager")
    assert not {"/host/etc/containerd", "/host/run/containerd"} & set(mounts)
    assert not any("artifacts" in path for path in mounts)
    assert set(rules(rendered.get("ClusterRole"))) == {"nodes"}
    assert set(rules(rendered.get("Role"))) == {"events"}
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
def test_sandbox_off_has_no_privilege_and_no_vfio(chart):
    # Even with every sandbox component switched on, the master switch wins.
    rendered = render(chart, merged(FULL, {"sandboxWorkloads": {"enabled": False}}))
    assert [ds["metadata"]["name"] for ds in rendered.daemonsets()] == [f"{RELEASE}-device-plugin"]
    for ds, c in rendered.containers():
        assert not c.get("securityContext", {}).get("privileged")
        assert not ds["spec"]["template"]["spec"].get("hostPID")
        assert "--mode" in c["args"] and c["args"][c["args"].index("--mode") + 1] == "container"
        assert not any("vfio" in m["mountPath"] for m in c.get("volumeMounts", []))
    assert rendered.find("ConfigMap", "-config") is None
    assert rendered.find("Role") is None
    assert set(rules(rendered.get("ClusterRole"))) == {"nodes"}


@pytest.mark.integration
def test_disabled_components_render_nothing(chart):
    agent_only = render(chart, VALUE_SETS["agent-only"])
    assert [ds["metadata"]["name"] for ds in agent_only.daemonsets()] == [f"{RELEASE}-sandbox-agent"]
    assert container_names(agent_only, "-sandbox-agent") == ["kata-manager"]
    pod = agent_only.get("DaemonSet", "-sandbox-agent")["spec"]["template"]["spec"]
    assert not {"device-plugins", "pod-resources"} & {v["name"] for v in pod["volumes"]}

    nothing = render(chart, VALUE_SETS["sandbox-nothing-enabled"])
    assert nothing.find("DaemonSet", "-sandbox-agent") is None
    assert nothing.find("ConfigMap", "-config") is None
    assert nothing.find("Role") is None

    plugin_only = render(chart, merged(SANDBOX, {"vfioManager": {"enabled": False},
                                                 "cdi": {"enabled": False}}))
    assert container_names(plugin_only, "-sandbox-agent") == ["sandbox-device-plugin"]
    assert plugin_only.find("ConfigMap", "-config") is None


@pytest.mark.integration
def test_alias_restart_mode_and_runtime_class_options(chart):
    rendered = render(chart, VALUE_SETS["alias-no-restart"])
    plugin = container(rendered, "-sandbox-agent", "sandbox-device-plugin")
    assert plugin["args"][-2:] == ["--alias", "pgpu"]
    # restartMode none: nothing to signal, so neither host PID nor host network namespace.
    pod = rendered.get("DaemonSet", "-sandbox-agent")["spec"]["template"]["spec"]
    assert not pod.get("hostPID") and not pod.get("hostNetwork")
    fallback = rendered.get("DaemonSet", "-device-plugin")["spec"]["template"]["spec"]
    assert fallback["runtimeClassName"] == "nvidia"


# --- scheduling follows nvidia.com/gpu.workload.config ---------------------------------

NODES = {
    "unlabeled-gpu": {"nvidia.com/gpu.present": "true"},
    "container": {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.workload.config": "container"},
    "vm-passthrough": {"nvidia.com/gpu.present": "true",
                       "nvidia.com/gpu.workload.config": "vm-passthrough"},
    "vm-vgpu": {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.workload.config": "vm-vgpu"},
    "cpu-only": {"kubernetes.io/os": "linux"},
}


@pytest.mark.parametrize(("values", "expected"), [
    ({}, {"unlabeled-gpu": ["device-plugin"], "container": ["device-plugin"],
          "vm-passthrough": ["device-plugin"], "vm-vgpu": ["device-plugin"], "cpu-only": []}),
    (FULL, {"unlabeled-gpu": ["device-plugin"], "container": ["device-plugin"],
            "vm-passthrough": ["sandbox-agent"], "vm-vgpu": [], "cpu-only": []}),
    (merged(FULL, {"sandboxWorkloads": {"defaultWorkload": "vm-passthrough"}}),
     {"unlabeled-gpu": ["sandbox-agent"], "container": ["device-plugin"],
      "vm-passthrough": ["sandbox-agent"], "vm-vgpu": [], "cpu-only": []}),
    (merged(FULL, {"sandboxWorkloads": {"defaultWorkload": "vm-vgpu"}}),
     {"unlabeled-gpu": [], "container": ["device-plugin"],
      "vm-passthrough": ["sandbox-agent"], "vm-vgpu": [], "cpu-only": []}),
], ids=["sandbox-off", "default-container", "default-vm-passthrough", "default-vm-vgpu"])
@pytest.mark.integration
def test_each_gpu_node_gets_the_agent_of_its_workload(chart, values, expected):
    rendered = render(chart, values)
    placed = {
        node: sorted(ds["metadata"]["labels"]["app.kubernetes.io/component"]
                     for ds in rendered.daemonsets() if workload_match(ds, labels))
        for node, labels in NODES.items()
    }
    assert placed == expected


@pytest.mark.integration
def test_custom_tolerations_root_fs_and_update_strategy(chart):
    rendered = render(chart, VALUE_SETS["tolerations-rootfs-vm-default"])
    for ds in rendered.daemonsets():
        assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
        pod = ds["spec"]["template"]["spec"]
        assert pod["tolerations"] == TOLERATIONS
        for volume in pod["volumes"]:
            if "hostPath" in volume:
                assert volume["hostPath"]["path"].startswith("/node/"), volume
    # Inside the containers the host still appears at /host, so --host-root /host holds.
    assert host_mounts(rendered, "-sandbox-agent", "kata-manager")["/host/sys"] == ("/node/sys", False)
    assert host_mounts(rendered, "-device-plugin", "device-plugin") == {
        "/host/var/lib/kubelet/device-plugins": ("/node/var/lib/kubelet/device-plugins", False),
        "/host/var/lib/kubelet/pod-resources": ("/node/var/lib/kubelet/pod-resources", True),
    }


# --- bad values are refused with a message that names them ------------------------------

@pytest.mark.parametrize(("values", "fragments"), [
    ({"sandboxWorkloads": {"enabled": "yes"}},
     ["/sandboxWorkloads/enabled", "boolean"]),
    ({"sandboxWorkloads": {"defaultWorkload": "vm-gpu"}},
     ["/sandboxWorkloads/defaultWorkload", "container", "vm-passthrough", "vm-vgpu"]),
    ({"kataManager": {"config": {"runtimeClasses": [
        {"name": "Kata_GPU", "artifacts": {"url": "registry.local/kata:1"}}]}}},
     ["/kataManager/config/runtimeClasses/0/name", "Kata_GPU"]),
    ({"kataManger": {"enabled": True}}, ["kataManger", "not allowed"]),
    # vfioManager.image is a GPU Operator key, accepted (and ignored); imageTag is no one's.
    ({"vfioManager": {"enabled": True, "imageTag": "cuda"}}, ["/vfioManager", "'imageTag'"]),
    ({"hostPaths": {"rootFS": "host"}}, ["/hostPaths/rootFS", "host"]),
    ({"kataManager": {"config": {"artifactsDir": "/opt/../etc"}}},
     ["/kataManager/config/artifactsDir"]),
    ({"daemonsets": {"tolerations": {"key": "nvidia.com/gpu"}}},
     ["/daemonsets/tolerations", "array"]),
    ({"containerd": {"restartMode": "reboot"}}, ["/containerd/restartMode", "signal"]),
    ({"kataManager": {"ociLayoutDirs": ["/srv/layouts", "layouts"]}},
     ["/kataManager/ociLayoutDirs/1", "layouts"]),
    ({"kataManager": {"ociLayoutDirs": ["/srv/../etc"]}}, ["/kataManager/ociLayoutDirs/0"]),
    ({"kataManager": {"ociLayoutDirs": ["/"]}}, ["/kataManager/ociLayoutDirs/0"]),
], ids=["wrong-type", "unknown-workload", "bad-runtime-class-name", "unknown-top-level-key",
        "unknown-nested-key", "relative-root", "path-traversal", "tolerations-not-a-list",
        "unknown-restart-mode", "relative-layout-dir", "layout-dir-traversal", "layout-dir-root"])
@pytest.mark.integration
def test_schema_rejects_bad_values_naming_them(helm, chart, values, fragments):
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
    report = helm.lint(CHART, values, namespace=NAMESPACE)
    assert report["errors"], "helm lint accepted values the schema refuses"


@pytest.mark.integration
def test_duplicate_runtime_class_names_are_refused(helm, chart):
    classes = [{"name": "kata-gpu", "artifacts": {"url": "registry.local/kata:1"}}] * 2
    with pytest.raises(helm.HelmError, match='"kata-gpu" appears twice'):
        render(chart, merged(FULL, {"kataManager": {"config": {"runtimeClasses": classes}}}))


@pytest.mark.integration
def test_daemonset_labels_and_annotations_reach_the_pods_not_the_selector(chart):
    rendered = render(chart, VALUE_SETS["plugin-only-annotated"])
    for ds in rendered.daemonsets():
        template = ds["spec"]["template"]["metadata"]
        assert template["labels"]["tier"] == "node"
        assert template["annotations"] == {"team": "gpu"}
        assert "tier" not in ds["spec"]["selector"]["matchLabels"]
        assert set(ds["spec"]["selector"]["matchLabels"].items()) <= set(template["labels"].items())


@pytest.mark.parametrize("values", [FULL, CUSTOM_CLASSES, VALUE_SETS["example-mixed-cluster"],
                                    VALUE_SETS["air-gapped"], VALUE_SETS["example-air-gapped"]],
                         ids=["defaults", "custom-classes", "example-mixed-cluster", "air-gapped",
                              "example-air-gapped"])
@pytest.mark.integration
def test_katamgr_accepts_the_config_the_chart_writes(chart, values):
    from katamgr.config import parse_config

    text = render(chart, values).get("ConfigMap", "-config")["data"]["config.yaml"]
    config = parse_config(text, source="ConfigMap config.yaml")
    classes = chart.merge_values(values)["kataManager"]["config"]["runtimeClasses"]
    assert [rc.name for rc in config.runtime_classes] == [rc["name"] for rc in classes]
    assert config.containerd.restart_mode == "signal"


# --- the agents' own parsers accept the arguments the chart passes ------------------------
# A missing Helm engine fails these under REQUIRE_INTEGRATION through the helm fixture.

def _subcommands(parser) -> dict:
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


@pytest.mark.parametrize("values", [FULL, VALUE_SETS["vfio-off"], VALUE_SETS["kata-off"],
                                    merged(FULL, {"cdi": {"enabled": False}}),
                                    VALUE_SETS["tolerations-rootfs-vm-default"],
                                    merged(FULL, {"sandboxWorkloads": {"defaultWorkload": "vm-vgpu"}})],
                         ids=["full", "vfio-off", "kata-off", "cdi-off", "default-vm-passthrough",
                              "default-vm-vgpu"])
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


@pytest.mark.parametrize("values", [{}, merged(FULL, {"sandboxDevicePlugin": {"alias": "pgpu"}})],
                         ids=["container", "vm-passthrough-alias"])
def test_device_plugin_understands_its_arguments(chart, values):
    from sandbox_plugin import cli

    rendered = render(chart, values)
    for _, c in rendered.containers():
        if c["command"] == ["sandbox-device-plugin"]:
            args = [a.replace("$(NODE_NAME)", "gpu-node-1") for a in c["args"]]
            cli.build_parser().parse_args(args)
