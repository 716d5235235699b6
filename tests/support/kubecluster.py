"""The real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, built from k8s.io/kubernetes by hack/kube/build) started by
``hack/local-cluster up`` for the control-plane suite (tests/controlplane) and
bench/bench_scale.py: the admin client, kubectl, ServiceAccount tokens the API server
issues, and the waits the tests need. Everything here talks to the real API server; the
in-process stand-in is tests/support/apiserver.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from support.paths import REPO
from support.waiting import wait_for  # noqa: F401 - the one rule, imported from here by the cluster tests

LOCAL_CLUSTER = REPO / "hack" / "local-cluster"
BUILD = REPO / "hack" / "kube" / "build"
# The kinds the chart and the tests make that have no namespace.
CLUSTER_SCOPED = {"Namespace", "Node", "ClusterRole", "ClusterRoleBinding", "RuntimeClass",
                  "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
                  "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
                  "PriorityClass", "DeviceClass", "CustomResourceDefinition"}
# A cached start takes ~5 s on 2 cores; the bound also covers a cold build (~6 min), which
# .ci/run does before the tests but a newcomer's first `pytest` may do here.
UP_TIMEOUT = 1800


def missing_part() -> str | None:
    """Why the real control plane cannot run here, or None."""
    if shutil.which("openssl") is None:
        return "openssl is not installed (run: bash .ci/setup)"
    if shutil.which("go") is None and not os.environ.get("KUBE_BIN_DIR"):
        return "no Go toolchain to build the Kubernetes components (install Go 1.25+)"
    return None


def placed(objects: list[dict[str, Any]], namespace: str | None) -> list[dict[str, Any]]:
    """Each namespaced object without a namespace put in ``namespace``, as `helm install
    -n` does (kubectl's own -n refuses a set that names other namespaces too)."""
    out = []
    for obj in objects:
        if namespace and obj["kind"] not in CLUSTER_SCOPED and not obj["metadata"].get("namespace"):
            obj = {**obj, "metadata": {**obj["metadata"], "namespace": namespace}}
        out.append(obj)
    return out


@dataclass
class LocalCluster:
    dir: Path
    start_seconds: float = 0.0

    @property
    def state(self) -> dict[str, Any]:
        return json.loads((self.dir / "state.json").read_text())

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.state['ports']['kube-apiserver']}"

    @property
    def ca(self) -> Path:
        return self.dir / "pki" / "ca.crt"

    @property
    def bin(self) -> Path:
        return Path(self.state["bin"])

    # --- lifecycle ----------------------------------------------------------------------

    @property
    def host_root(self) -> Path:
        """The node's simulated host root (clusters started with a node)."""
        return Path(self.state["host_root"])

    @classmethod
    def up(cls, directory: Path, node: bool = False) -> LocalCluster:
        started = time.monotonic()
        result = subprocess.run([str(LOCAL_CLUSTER), "up", str(directory),
                                 *(["--node"] if node else [])],
                                capture_output=True, text=True, timeout=UP_TIMEOUT)
        if result.returncode:
            raise RuntimeError(f"hack/local-cluster up failed ({result.returncode}):\n"
                               f"{result.stdout}\n{result.stderr}")
        cluster = cls(directory)
        cluster.start_seconds = time.monotonic() - started
        return cluster

    def down(self) -> str:
        result = subprocess.run([str(LOCAL_CLUSTER), "down", str(self.dir)],
                                capture_output=True, text=True, timeout=120)
        return result.stdout + result.stderr

    def component(self, command: str, component: str) -> str:
        """``hack/local-cluster stop|start|restart DIR COMPONENT``."""
        return self._local_cluster(command, component)

    def reboot(self) -> str:
        """``hack/local-cluster reboot DIR``: the node powered off and on."""
        return self._local_cluster("reboot")

    def _local_cluster(self, command: str, *rest: str) -> str:
        result = subprocess.run([str(LOCAL_CLUSTER), command, str(self.dir), *rest],
                                capture_output=True, text=True, timeout=UP_TIMEOUT)
        if result.returncode:
            raise RuntimeError(f"hack/local-cluster {' '.join([command, *rest])} failed:\n"
                               f"{result.stdout}{result.stderr}")
        return result.stdout

    def log(self, component: str) -> str:
        return (self.dir / "logs" / f"{component}.log").read_text(errors="replace")

    # --- clients ------------------------------------------------------------------------

    def client(self, kubeconfig: Path | None = None):
        """The official Python client, as cluster admin unless another kubeconfig is given."""
        from kubernetes.client import ApiClient, Configuration
        from kubernetes.config.kube_config import load_kube_config

        configuration = Configuration()
        load_kube_config(config_file=str(kubeconfig or self.kubeconfig),
                         client_configuration=configuration, persist_config=False)
        return ApiClient(configuration)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                kubeconfig: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        env = {**os.environ, "KUBECONFIG": str(kubeconfig or self.kubeconfig)}
        result = subprocess.run([str(self.bin / "kubectl"), *args], input=input, env=env,
                                capture_output=True, text=True, timeout=timeout)
        if check and result.returncode:
            raise AssertionError(f"kubectl {' '.join(args)} exited {result.returncode}:\n"
                                 f"{result.stdout}\n{result.stderr}")
        return result

    def get(self, *args: str) -> dict[str, Any]:
        return json.loads(self.kubectl("get", *args, "--show-managed-fields", "-o", "json").stdout)

    def apply(self, objects: list[dict[str, Any]], *, manager: str = "helm",
              namespace: str | None = None) -> subprocess.CompletedProcess:
        """Server-side apply, as `helm install --server-side` and `kubectl apply
        --server-side` do; the API server's admission runs on every object."""
        text = yaml.safe_dump_all(placed(objects, namespace), sort_keys=False)
        return self.kubectl("apply", "--server-side", "--field-manager", manager, "-f", "-",
                            input=text)

    def delete(self, objects: list[dict[str, Any]], namespace: str | None = None) -> None:
        text = yaml.safe_dump_all(placed(objects, namespace), sort_keys=False)
        self.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-", input=text)

    def namespace(self, name: str) -> str:
        self.kubectl("create", "namespace", name, check=False)
        # Pods need the namespace's `default` ServiceAccount, which the controller manager's
        # serviceaccount controller makes; the ServiceAccount admission plugin refuses
        # pods until then.
        wait_for(lambda: self.kubectl("get", "serviceaccount", "default", "-n", name,
                                      check=False).returncode == 0,
                 f"the default ServiceAccount of namespace {name}")
        return name

    def token(self, namespace: str, service_account: str, seconds: int = 3600) -> str:
        """A token the API server issues for the ServiceAccount (TokenRequest), as the
        kubelet projects into a pod."""
        return self.kubectl("create", "token", service_account, "-n", namespace,
                            "--duration", f"{seconds}s").stdout.strip()

    def service_account_kubeconfig(self, namespace: str, service_account: str,
                                   path: Path) -> Path:
        config = {
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "local", "cluster": {
                "server": self.server, "certificate-authority": str(self.ca)}}],
            "users": [{"name": service_account,
                       "user": {"token": self.token(namespace, service_account)}}],
            "contexts": [{"name": "local", "context": {
                "cluster": "local", "user": service_account, "namespace": namespace}}],
            "current-context": "local",
        }
        path.write_text(json.dumps(config))
        path.chmod(0o600)
        return path

    def can_i(self, verb: str, resource: str, *, kubeconfig: Path, namespace: str | None = None,
              name: str | None = None, subresource: str | None = None) -> bool:
        """The API server's own answer (SelfSubjectAccessReview) for that identity."""
        args = ["auth", "can-i", verb, resource if not name else f"{resource}/{name}"]
        if subresource:
            args += ["--subresource", subresource]
        args += ["-n", namespace] if namespace else ["--all-namespaces"]
        result = self.kubectl(*args, kubeconfig=kubeconfig, check=False)
        return result.stdout.strip() == "yes"

    # --- etcd -----------------------------------------------------------------------------

    def etcd(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """etcd's v3 JSON gateway (the same API etcdctl speaks over gRPC)."""
        url = f"http://127.0.0.1:{self.state['ports']['etcd']}{path}"
        request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - loopback
            return json.loads(response.read())

    def etcd_compact(self) -> int:
        """Compact etcd at its current revision, as the API server does every 5 minutes:
        every older resourceVersion is gone from then on."""
        revision = int(self.etcd("/v3/kv/range", {"key": "AA=="})["header"]["revision"])
        self.etcd("/v3/kv/compaction", {"revision": str(revision), "physical": True})
        return revision
