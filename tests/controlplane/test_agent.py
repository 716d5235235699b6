"""The sandbox agent (``katamgr run``) on a simulated DGX H100 node, talking to the real
API server with the token the API server issues to the chart's ServiceAccount: the
RuntimeClasses left to Helm (the chart's --no-runtime-classes; katamgr run by hand still
applies them server-side, nothing written on a second run), the Node's workload label
followed through an API server restart and an expired (410) watch, Events readable with the
API, and the chart's uninstall hook (``katamgr revert`` with the hook's own arguments and no
token) putting the node back.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from support.chartkit import render_release
from support.kataconfig import kata_manager_yaml
from support.kubecluster import wait_for
from support.paths import REPO
from support.registry_server import free_port

from gpunode.kataclasses import offer_label

pytestmark = pytest.mark.integration

RELEASE = "ksm-agent"
NODE = "sim-dgx-1"
GPU, SNP = "kata-qemu-nvidia-gpu", "kata-qemu-nvidia-gpu-snp"
WORKLOAD = "nvidia.com/gpu.workload.config"
KATAMGR = str(Path(sys.executable).parent / "katamgr")
CONFIG = kata_manager_yaml((GPU, SNP), overhead={"cpu": "250m", "memory": "160Mi"})
# Without the GPU labels (tests/pipeline/test_gpu_labels_on_node.py has them): here the agent's
# token may write no Node at all, and the uninstall hook's pods get no token.
VALUES = {"sandboxWorkloads": {"enabled": True}, "kataManager": {"enabled": True},
          "gpuLabels": {"enabled": False}}
ACCOUNT_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


def is_hook(obj) -> bool:
    return "helm.sh/hook" in obj["metadata"].get("annotations", {})


@pytest.fixture(scope="module")
def release(kube):
    """The chart's ServiceAccounts and RBAC (agent and uninstall hook) applied to the real
    API server: the identities the agent and the hook run as. The DaemonSets are left
    out: no kubelet runs here to start them."""
    objects = render_release(VALUES, RELEASE)
    accounts = [o for o in objects if o["kind"] in ACCOUNT_KINDS]
    kube.namespace(RELEASE)
    kube.apply(accounts, namespace=RELEASE)
    yield objects
    kube.delete(accounts, namespace=RELEASE)


@pytest.fixture(scope="module")
def node(kube, tmp_path_factory):
    """A simulated DGX H100 host root with containerd's config and the Kata artifacts'
    OCI layout on it, and its Node object labelled vm-passthrough."""
    root = tmp_path_factory.mktemp("node") / "host"
    subprocess.run([KATAMGR, "simulate", "dgx-h100", "--into", str(root)], check=True,
                   capture_output=True)
    (root / "etc/containerd").mkdir(parents=True)
    shutil.copy(REPO / "katamgr/data/demo/containerd-config.toml", root / "etc/containerd/config.toml")
    shutil.copytree(REPO / "katamgr/data/oci-layout", root / "opt/kata-artifacts/layout")
    config = root.parent / "config.yaml"
    config.write_text(CONFIG)
    kube.apply([{"apiVersion": "v1", "kind": "Node",
                 "metadata": {"name": NODE, "labels": {WORKLOAD: "vm-passthrough"}}}],
               manager="test")
    yield root, config
    kube.kubectl("delete", "node", NODE, "--wait=false", check=False)
    kube.kubectl("delete", "runtimeclass", GPU, SNP, "--ignore-not-found", check=False)


def gpu_drivers(root: Path) -> dict[str, str]:
    """BDF -> driver of every NVIDIA GPU on the simulated node."""
    out = {}
    for dev in sorted((root / "sys/bus/pci/devices").iterdir()):
        if (dev / "vendor").read_text().strip() != "0x10de":
            continue
        if not (dev / "class").read_text().strip().startswith("0x0302"):
            continue
        link = dev / "driver"
        out[dev.name] = os.readlink(link).rsplit("/", 1)[-1] if link.is_symlink() else ""
    return out


def agent_env(kube, tmp_path, account: str) -> dict[str, str]:
    kubeconfig = kube.service_account_kubeconfig(RELEASE, account, tmp_path / f"{account}.kubeconfig")
    return {**os.environ, "KUBECONFIG": str(kubeconfig), "POD_NAMESPACE": RELEASE,
            "NODE_NAME": NODE}


def agent_account(release) -> str:
    """The sandbox agent DaemonSet's ServiceAccount (its pods' identity)."""
    agent = next(o for o in release if o["kind"] == "DaemonSet" and not is_hook(o)
                 and o["metadata"]["name"].endswith("-sandbox-agent"))
    return agent["spec"]["template"]["spec"]["serviceAccountName"]


def chart_flags(release) -> list[str]:
    """The agent's arguments the chart passes that decide what it writes to the cluster."""
    agent = next(o for o in release if o["kind"] == "DaemonSet" and not is_hook(o)
                 and o["metadata"]["name"].endswith("-sandbox-agent"))
    args = next(c for c in agent["spec"]["template"]["spec"]["containers"] if c["name"] == "kata-manager")["args"]
    return [a for a in args if a in ("--no-runtime-classes", "--no-gpu-labels")]


def run_once(kube, node, env, flags: list[str] = ()) -> subprocess.CompletedProcess:
    root, config = node
    return subprocess.run([KATAMGR, "run", "--once", "--host-root", str(root), "--config",
                           str(config), "--node-name", NODE, *flags], env=env, capture_output=True,
                          text=True, timeout=120)


def runtime_class_versions(kube) -> dict[str, str]:
    return {name: kube.get("runtimeclass", name)["metadata"]["resourceVersion"] for name in (GPU, SNP)}


def test_the_agent_leaves_runtime_classes_to_helm_and_records_events_with_its_own_token(
        kube, release, node, tmp_path):
    env = agent_env(kube, tmp_path, agent_account(release))
    flags = chart_flags(release)
    assert flags == ["--no-runtime-classes", "--no-gpu-labels"]  # VALUES: gpuLabels off
    first = run_once(kube, node, env, flags)
    assert first.returncode == 0, first.stderr
    assert set(gpu_drivers(node[0]).values()) == {"vfio-pci"}
    names = {rc["metadata"]["name"] for rc in kube.get("runtimeclasses")["items"]}
    assert GPU not in names and SNP not in names, "the chart's agent wrote a RuntimeClass"
    assert "RuntimeClass" not in first.stderr, first.stderr  # not tried, so nothing refused

    # The Events the agent recorded about its Node, as `kubectl describe node` finds them.
    events = [e for e in kube.get("events", "--all-namespaces")["items"]
              if e["involvedObject"]["name"] == NODE]
    assert events, "the agent recorded no Event on its Node:\n" + first.stderr[-3000:]
    assert all(e["involvedObject"]["kind"] == "Node" for e in events)
    assert "could not record event" not in first.stderr


def test_katamgr_by_hand_applies_runtime_classes_once(kube, release, node, tmp_path):
    """Outside the chart (no --no-runtime-classes, the operator's credentials) katamgr
    still applies the classes server-side, and a second run writes nothing."""
    env = {**os.environ, "KUBECONFIG": str(kube.kubeconfig), "POD_NAMESPACE": RELEASE, "NODE_NAME": NODE}
    try:
        first = run_once(kube, node, env)
        assert first.returncode == 0, first.stderr
        gpu = kube.get("runtimeclass", GPU)
        assert gpu["handler"] == GPU
        assert gpu["scheduling"]["nodeSelector"] == {WORKLOAD: "vm-passthrough", offer_label(GPU): "true"}
        assert gpu["overhead"]["podFixed"] == {"cpu": "250m", "memory": "160Mi"}
        assert gpu["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kata-sandbox-manager"
        snp = kube.get("runtimeclass", SNP)
        assert snp["scheduling"]["nodeSelector"] == {"nvidia.com/cc.capable": "true",
                                                     "nvidia.com/cc.ready.state": "true",
                                                     offer_label(SNP): "true"}
        # Server-side apply under our field manager: the API server records it as such.
        entries = [(e["manager"], e["operation"]) for e in gpu["metadata"]["managedFields"]]
        assert entries == [("kata-sandbox-manager", "Apply")]

        before = runtime_class_versions(kube)
        second = run_once(kube, node, env)
        assert second.returncode == 0, second.stderr
        assert runtime_class_versions(kube) == before, "a second run wrote the RuntimeClasses again"
    finally:
        kube.kubectl("delete", "runtimeclass", GPU, SNP, "--ignore-not-found", check=False)


def test_the_agent_token_is_refused_what_the_agent_never_does(kube, release, tmp_path):
    kubeconfig = kube.service_account_kubeconfig(RELEASE, agent_account(release),
                                                 tmp_path / "agent.kubeconfig")
    kube.namespace("other")
    refused = [
        ("delete", "nodes", None, NODE),
        ("list", "secrets", RELEASE, None),
        ("list", "secrets", "other", None),
        ("get", "secrets", "other", "anything"),
        ("create", "pods", RELEASE, None),
        ("create", "events", "other", None),
        # Helm owns the RuntimeClasses: no node's token may make, change or delete one.
        ("create", "runtimeclasses", None, None),
        ("patch", "runtimeclasses", None, GPU),
        ("delete", "runtimeclasses", None, GPU),
        ("list", "runtimeclasses", None, None),
    ]
    allowed = [
        # kataManager on: the agent labels its Node with the runtime classes it offers
        # (katamgr.pipeline.offers); the node-binding policy, not applied here, holds that patch
        # to those labels of its own Node (the node suite sends the real refused patch).
        ("patch", "nodes", None, NODE),
        ("get", "nodes", None, NODE),
        ("watch", "nodes", None, None),
        ("create", "events", "default", None),  # Node events live there
    ]
    for verb, resource, namespace, name in refused:
        assert not kube.can_i(verb, resource, kubeconfig=kubeconfig, namespace=namespace, name=name), \
            (verb, resource, namespace, name)
    for verb, resource, namespace, name in allowed:
        assert kube.can_i(verb, resource, kubeconfig=kubeconfig, namespace=namespace, name=name), \
            (verb, resource, namespace, name)
    # And the real call, not only the review: deleting its Node is forbidden.
    patch = kube.kubectl("delete", "node", NODE, kubeconfig=kubeconfig, check=False)
    assert patch.returncode != 0 and "forbidden" in patch.stderr.lower(), patch.stderr



def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:  # noqa: S310
            return response.status == 200
    except OSError:
        return False


def test_the_agent_follows_relabels_through_an_api_server_restart_and_a_410(kube, release, node, tmp_path):
    root, config = node
    env = agent_env(kube, tmp_path, agent_account(release))
    log = tmp_path / "agent.log"
    port = free_port()
    with open(log, "w") as out:
        agent = subprocess.Popen([KATAMGR, "run", "--host-root", str(root), "--config", str(config),
                                  "--node-name", NODE, "--metrics-address", f"127.0.0.1:{port}",
                                  *chart_flags(release)],
                                 env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: set(gpu_drivers(root).values()) == {"vfio-pci"}, "GPUs on vfio-pci", 60)
        # Ready once a reconcile succeeded; its Node watch resumes from the version the
        # start read, so a relabel from now on is seen whenever the watch opens.
        wait_for(lambda: ready(port), "the agent's /readyz", 60)

        started = time.monotonic()
        kube.kubectl("label", "node", NODE, f"{WORKLOAD}=container", "--overwrite")
        wait_for(lambda: set(gpu_drivers(root).values()) == {"nvidia"},
                 "GPUs given back to nvidia after the relabel to container", 30)
        to_container = time.monotonic() - started

        # The API server goes away with the watch open (a restart, an upgrade): the agent
        # reads its Node every 10 s meanwhile and watches again once the server is back.
        kube.component("restart", "kube-apiserver")
        started = time.monotonic()
        kube.kubectl("label", "node", NODE, f"{WORKLOAD}=vm-passthrough", "--overwrite")
        wait_for(lambda: set(gpu_drivers(root).values()) == {"vfio-pci"},
                 "GPUs back on vfio-pci after the API server restart", 60)
        back = time.monotonic() - started
        wait_for(lambda: f"watching node {NODE} again" in log.read_text(),
                 "the agent watching its Node again", 30)
        print(f"relabel followed in {to_container:.1f} s; after an API server restart in {back:.1f} s")
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
    assert agent.returncode == 0, log.read_text()[-4000:]


def test_a_watch_from_a_version_the_api_server_no_longer_has_is_410_gone(kube, release, node, tmp_path):
    """What the Node watch does when it resumes from a resourceVersion the API server no
    longer serves (its watch cache starts afresh on a restart, etcd is compacted every
    5 min): the real server answers 410 Gone, which the watch must take as "read the
    Node again", never as a failure or a stale answer."""
    from gpunode.services.kube import NodeLabelWatch, _Gone, read_node

    kubeconfig = kube.service_account_kubeconfig(RELEASE, agent_account(release), tmp_path / "kc")
    api = kube.client(kubeconfig)
    old = read_node(api, NODE).resource_version
    kube.kubectl("create", "configmap", "bump", "-n", RELEASE)
    kube.kubectl("delete", "configmap", "bump", "-n", RELEASE)
    kube.component("restart", "kube-apiserver")
    kube.etcd_compact()
    watch = NodeLabelWatch(api, NODE, watch_timeout=5)
    watch._version = old  # as a watch that ended before the restart left it
    with pytest.raises(_Gone):
        watch._watch_once()
    # And the whole watch: started afresh it reads the Node and follows it.
    watch = NodeLabelWatch(api, NODE, watch_timeout=5).start()
    try:
        kube.kubectl("label", "node", NODE, "example.com/seen=yes", "--overwrite")
        wait_for(lambda: watch.labels().get("example.com/seen") == "yes", "the label seen", 15)
    finally:
        watch.stop()
        kube.kubectl("label", "node", NODE, "example.com/seen-")


def test_the_uninstall_hook_reverts_the_node_even_without_a_token_and_leaves_the_classes(
        kube, release, node, tmp_path):
    """The hook's katamgr revert calls the API only to take the agent's offer labels off its
    Node (kataManager on: its pods get a token for that); without a token it still puts the
    node back and leaves every RuntimeClass to Helm. Its waiting Job's account may read the
    revert DaemonSet and nothing else."""
    root, config = node
    env = agent_env(kube, tmp_path, agent_account(release))
    assert run_once(kube, node, env, chart_flags(release)).returncode == 0
    kube.apply([{"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                 "metadata": {"name": "someone-elses", "labels": {
                     "app.kubernetes.io/managed-by": "kata-sandbox-manager"}}, "handler": "runc"}],
               manager="test")

    hook = next(o for o in release if o["kind"] == "DaemonSet" and is_hook(o))
    pod = hook["spec"]["template"]["spec"]
    assert pod.get("automountServiceAccountToken", True) is True  # for the offer labels (pipeline.offers)
    container = next(c for c in pod.get("initContainers", []) + pod["containers"] if c["name"] == "revert")
    args = list(container["args"])
    # The hook's own arguments, the host root and config pointed at the simulated node.
    args[args.index("--host-root") + 1] = str(root)
    args[args.index("--config") + 1] = str(config)
    # No token: no KUBECONFIG, no service account (a simulated node ignores ~/.kube/config).
    hook_env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    wait = next(o for o in release if o["kind"] == "Job" and is_hook(o))
    wait_account = wait["spec"]["template"]["spec"]["serviceAccountName"]
    wait_kubeconfig = Path(agent_env(kube, tmp_path, wait_account)["KUBECONFIG"])
    assert kube.can_i("get", "daemonsets", kubeconfig=wait_kubeconfig, namespace=RELEASE,
                      name=hook["metadata"]["name"])
    assert not kube.can_i("list", "secrets", kubeconfig=wait_kubeconfig, namespace=RELEASE)
    assert not kube.can_i("get", "nodes", kubeconfig=wait_kubeconfig, name=NODE)
    result = subprocess.run([KATAMGR, *args], env=hook_env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert set(gpu_drivers(root).values()) == {"nvidia"}
    names = {rc["metadata"]["name"] for rc in kube.get("runtimeclasses")["items"]}
    assert "someone-elses" in names
    kube.kubectl("delete", "runtimeclass", "someone-elses")
