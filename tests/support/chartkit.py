"""The Helm chart rendered by the real Helm v4 engine (helm-python-sdk), for the chart
tests (tests/chart) and the config schema tests (tests/config): where the chart is, the
release it is rendered as, the base value sets, and helpers that pick rendered objects apart.
The pytest fixtures ``helm``, ``chart`` and ``kube_validate`` are in tests/chart/conftest.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from support.paths import REPO, REQUIRE_INTEGRATION

CHART = REPO / "deploy" / "helm" / "kata-sandbox-manager"
RELEASE = "kata-sandbox-manager"
NAMESPACE = "gpu-sandbox"

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


# --- the real Helm engine ---------------------------------------------------------------

def load_helm():
    """helm_python, or skip (fail under REQUIRE_INTEGRATION=1) when it cannot load."""
    try:
        import helm_python
    except ImportError as exc:
        part_missing(f"helm-python-sdk is not installed ({exc}); run: pip install helm-python-sdk")
    try:
        helm_python.helm_sdk_version()  # loads the embedded Helm engine (libhelm_c)
    except (helm_python.HelmError, OSError) as exc:
        part_missing(f"helm-python-sdk cannot load its Helm engine: {exc}")
    return helm_python


def part_missing(message: str) -> None:
    if REQUIRE_INTEGRATION:
        pytest.fail(message)
    pytest.skip(message)


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

    def daemonsets(self, hooks: bool = False) -> list[dict[str, Any]]:
        """The release's DaemonSets; with ``hooks`` also those of Helm hooks (the
        uninstall revert), which run only while the hook does."""
        return [o for o in self.objects if o["kind"] == "DaemonSet" and (hooks or not is_hook(o))]

    def hooks(self) -> list[dict[str, Any]]:
        return [o for o in self.objects if is_hook(o)]

    def containers(self) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        for ds in self.daemonsets():
            for container in ds["spec"]["template"]["spec"]["containers"]:
                yield ds, container


def is_hook(obj: dict[str, Any]) -> bool:
    return "helm.sh/hook" in ((obj.get("metadata") or {}).get("annotations") or {})


@dataclass(frozen=True)
class Cluster:
    """What Helm learns from the API server at install time (``.Capabilities``): its version
    and the API versions and kinds it serves (``helm template --kube-version
    --api-versions``), beyond Helm's built-in defaults."""

    kube_version: str | None = None  # None: the Helm engine's default
    api_versions: tuple[str, ...] = ()


VALIDATING_ADMISSION_POLICY = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"
# A current cluster (Kubernetes 1.30+) serves ValidatingAdmissionPolicy v1, the capability
# the chart renders its admission policy by; one from before 1.30 does not.
CURRENT = Cluster(None, (VALIDATING_ADMISSION_POLICY, VALIDATING_ADMISSION_POLICY + "Binding"))
BEFORE_1_30 = Cluster("v1.29.0")


def cluster_at(version: str) -> Cluster:
    """The capabilities of a cluster of Kubernetes ``version`` ("1.25.0")."""
    major, minor = (int(part) for part in version.split(".")[:2])
    served = CURRENT.api_versions if (major, minor) >= (1, 30) else ()
    return Cluster(f"v{version}", served)


def manifests(chart, values: dict[str, Any], cluster: Cluster = CURRENT, *,
              release: str = RELEASE, namespace: str = NAMESPACE) -> dict[str, str]:
    """Template path -> rendered text (NOTES.txt included), as installed on ``cluster``."""
    options: dict[str, Any] = {"name": release, "namespace": namespace, "is_install": True}
    if cluster.kube_version:
        options["kube_version"] = cluster.kube_version
    if cluster.api_versions:
        options["api_versions"] = list(cluster.api_versions)
    # helm-python-sdk's Chart.render passes the engine only name, namespace, revision and
    # install/upgrade; the engine's render options also take kube_version and api_versions
    # (what helm template's --kube-version and --api-versions set), so they are passed to it
    # the way Chart.render passes its own.
    from helm_python import _native

    text = _native.call_string("helm_render", chart._raw(), json.dumps(values),
                               json.dumps(options))
    return json.loads(text)


def render(chart, values: dict[str, Any], cluster: Cluster = CURRENT) -> Rendered:
    objects = [
        obj
        for path, text in sorted(manifests(chart, values, cluster).items())
        if path.endswith((".yaml", ".yml"))
        for obj in yaml.safe_load_all(text) if obj
    ]
    return Rendered(objects)


def notes(chart, values: dict[str, Any], cluster: Cluster = CURRENT) -> str:
    return next(text for path, text in manifests(chart, values, cluster).items()
                if path.endswith("NOTES.txt"))


def workloads(rendered: Rendered) -> list[dict[str, Any]]:
    """Every object that runs pods (hooks included), by its pod template."""
    return [o for o in rendered.objects
            if (o.get("spec") or {}).get("template", {}).get("spec", {}).get("containers")]


def pod_containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    """A workload's containers and init containers."""
    pod = workload["spec"]["template"]["spec"]
    return [*pod.get("initContainers", []), *pod["containers"]]


def render_release(values: dict[str, Any], release: str) -> list[dict[str, Any]]:
    """The chart rendered as ``release`` into the namespace of the same name, every object
    (hooks included) in template order, for applying to a real API server (a current one:
    it serves ValidatingAdmissionPolicy v1, as Helm would find at install time)."""
    helm = load_helm()
    with helm.Chart.load(CHART) as chart:
        rendered = manifests(chart, values, CURRENT, release=release, namespace=release)
    return [obj for path, text in sorted(rendered.items()) if path.endswith((".yaml", ".yml"))
            for obj in yaml.safe_load_all(text) if obj]


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


def env_names(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in c.get("env", [])}
