"""An artifact upgrade that goes bad, held on the real node, then rolled back.

The chart is applied from our image with examples/values/local-node.yaml (the package
fixture); a Kata pod with one GPU runs, its VM holding the GPU's VFIO group (nodeswitch.VmPod).
Then the runtime class's artifacts are changed to a new tag of the node's OCI layout whose
Kata config blob is not the bytes its manifest's sha256 names (a registry serving a bad push),
and the chart is re-applied as ``helm upgrade`` does: the real DaemonSet controller replaces
the agent's pod. What a user sees: the new agent stays unready, its /readyz naming the class,
what is installed and what was asked; a KataArtifactsUnverified Event on the Node says the
same; ``kubectl rollout status`` waits; the Kata pod runs on with its GPU, the old artifacts
stay installed byte for byte, no GPU leaves vfio-pci. Then the previous values are re-applied,
as ``helm rollback`` does: the agent is Ready and the rollout completes.

Facts from Kubernetes (v1.35.4): the DaemonSet controller's RollingUpdate replaces at most
maxUnavailable pods and counts a pod available once Ready for minReadySeconds
(pkg/controller/daemon/update.go); ``kubectl rollout status`` on a DaemonSet waits while
updatedNumberScheduled or numberAvailable is below desiredNumberScheduled, printing
"Waiting for daemon set ... rollout to finish: N of M updated pods are available...", and says
"successfully rolled out" once neither is (kubectl/pkg/polymorphichelpers/rollout_status.go,
DaemonSetStatusViewer); the kubelet's failed HTTP probe message is "HTTP probe failed with
statuscode: 503", without the body (pkg/probe/http/http.go), recorded as an Unhealthy Event.
A changed kataManager config rolls the agent (the pod template's checksum/config annotation).
The chart's defaults here: maxUnavailable 1, minReadySeconds 30, the probe every 10 s.
"""

from __future__ import annotations

import hashlib
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.kubecluster import wait_for
from support.nodekit import AGENT, GPU_RESOURCE, KATA_CLASS, is_ready, vm_devices
from support.nodekit import NAMESPACE as RELEASE_NAMESPACE
from support.nodeswitch import NAMESPACE as VM_NAMESPACE
from support.nodeswitch import VmPod
from support.paths import REPO

from gpunode.kataclasses import offer_label
from katamgr.artifacts import read_install

NODE_VALUES = REPO / "examples" / "values" / "local-node.yaml"
AGENT_PORT = 9410  # the chart's metrics.agentPort
LAYOUT = "/opt/kata-artifacts/layout"  # hack/local-cluster's OCI layout in the node's host
GOOD = f"oci-layout://{LAYOUT}:{KATA_CLASS}"  # what local-node.yaml installs
BAD_TAG = "v2-corrupt"
BAD = f"oci-layout://{LAYOUT}:{BAD_TAG}"
CLASS_DIR = f"/opt/nvidia-gpu-operator/artifacts/runtimeclasses/{KATA_CLASS}"  # local-node.yaml's artifactsDir
CONFIG_LAYER = "configuration-qemu-nvidia-gpu.toml"
# An agent pod replaced, started on this 2-core machine and its first reconcile done (8 GPUs
# bound by the emulated kernel, the artifacts fetched and checked).
ROLL_TIMEOUT = 240
RECONCILE_TIMEOUT = 180
PROBE_TIMEOUT = 60  # the kubelet's readiness probe, every 10 s
MIN_READY_S = 30  # the chart's daemonsets.minReadySeconds


def corrupt_tag(layout: Path) -> list[Path]:
    """Tag ``BAD_TAG`` in ``layout``: the class's manifest with its Kata config layer made new
    (a line appended), the blob stored under that layer's digest holding other bytes of the
    same length. The blobs written, for the cleanup."""
    blobs = layout / "blobs" / "sha256"
    index = json.loads((layout / "index.json").read_text())
    entry = next(m for m in index["manifests"]
                 if m["annotations"]["org.opencontainers.image.ref.name"] == KATA_CLASS)
    manifest = json.loads((blobs / entry["digest"].removeprefix("sha256:")).read_text())
    layer = next(x for x in manifest["layers"] if x["annotations"]["org.opencontainers.image.title"] == CONFIG_LAYER)
    asked = (blobs / layer["digest"].removeprefix("sha256:")).read_bytes() + b"\n# v2\n"
    stored = asked[:-2] + b"!\n"  # what the push left in storage: not the bytes the digest names
    written = [blobs / hashlib.sha256(asked).hexdigest()]
    written[0].write_bytes(stored)
    layer["digest"], layer["size"] = "sha256:" + written[0].name, len(asked)
    body = json.dumps(manifest).encode()
    written.append(blobs / hashlib.sha256(body).hexdigest())
    written[1].write_bytes(body)
    index["manifests"].append({**entry, "digest": "sha256:" + written[1].name, "size": len(body),
                               "annotations": {"org.opencontainers.image.ref.name": BAD_TAG}})
    (layout / "index.json").write_text(json.dumps(index))
    return written


def values_with(url: str) -> dict:
    values = yaml.safe_load(NODE_VALUES.read_text())
    (rc,) = [c for c in values["kataManager"]["config"]["runtimeClasses"] if c["name"] == KATA_CLASS]
    rc["artifacts"]["url"] = url
    return values


def installed(node) -> tuple[str | None, dict[str, str]]:
    """The class's install record's reference, and the sha256 of every file of its dir."""
    dest = node.cluster.host_root / CLASS_DIR.lstrip("/")
    record = read_install(dest)
    root = dest.resolve()
    files = {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}
    return (record.ref if record else None), files


def daemonset(node) -> dict[str, Any]:
    out = node.cluster.kubectl("get", "daemonsets", "-n", RELEASE_NAMESPACE, "-l", AGENT, "-o", "json").stdout
    (found,) = json.loads(out)["items"]
    return found


def rollout_status(node, timeout: str) -> tuple[int, str]:
    """``kubectl rollout status ds/<agent>``, waiting at most ``timeout``."""
    name = daemonset(node)["metadata"]["name"]
    result = node.cluster.kubectl("rollout", "status", f"daemonset/{name}", "-n", RELEASE_NAMESPACE,
                                  f"--timeout={timeout}", check=False, timeout=300)
    return result.returncode, result.stdout + result.stderr


def rolled_agent(node) -> dict[str, Any] | None:
    """The agent's one pod once it is of the DaemonSet's current template and its
    kata-manager container runs; None before."""
    want = daemonset(node)["spec"]["template"]["metadata"].get("annotations", {}).get("checksum/config")
    pods = [p for p in node.pods(AGENT) if not p["metadata"].get("deletionTimestamp")]
    if len(pods) != 1 or (pods[0]["metadata"].get("annotations") or {}).get("checksum/config") != want:
        return None
    running = {c["name"]: "running" in c.get("state", {}) for c in pods[0]["status"].get("containerStatuses", [])}
    return pods[0] if running.get("kata-manager") and pods[0]["status"].get("podIP") else None


def apply_chart(node, values: dict | None, tmp: Path) -> dict[str, Any]:
    """The chart re-applied (``values``; None: the node's own), the agent's pod rolled and running."""
    extra = []
    if values is not None:
        path = tmp / f"values-{time.monotonic_ns()}.yaml"
        path.write_text(yaml.safe_dump(values))
        extra = ["--values", str(path)]
    node.cluster_chart("up", *extra)
    try:
        return wait_for(lambda: rolled_agent(node), "the agent's pod rolled to the values and running",
                        ROLL_TIMEOUT, every=1)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{node.describe(AGENT)}") from None


def readyz(pod: dict[str, Any]) -> tuple[int, str]:
    """A GET of the agent's /readyz through the pod's address, as the kubelet probes it."""
    url = f"http://{pod['status']['podIP']}:{AGENT_PORT}/readyz"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - a pod on this node
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def pod_events(node, pod: dict[str, Any], reason: str) -> list[dict[str, Any]]:
    selector = f"involvedObject.uid={pod['metadata']['uid']},reason={reason}"
    out = node.cluster.kubectl("get", "events", "-n", pod["metadata"]["namespace"], "--field-selector",
                               selector, "-o", "json").stdout
    return json.loads(out)["items"]


def containers_ready(node, pod: dict[str, Any]) -> dict[str, bool]:
    statuses = node.pod(pod["metadata"]["name"], RELEASE_NAMESPACE)["status"].get("containerStatuses", [])
    return {c["name"]: c["ready"] for c in statuses}


@pytest.fixture(scope="module")
def vm(node, tmp_path_factory):
    """A Kata pod with one GPU held by its VM; afterwards the layout, the chart and the agent as
    the package fixture left them."""
    node.cluster.namespace(VM_NAMESPACE)
    node.wait_resource(GPU_RESOURCE, 8, timeout=120)
    layout = node.cluster.host_root / LAYOUT.lstrip("/")
    index = (layout / "index.json").read_bytes()
    written: list[Path] = []
    resident = VmPod(node, "through-the-rollout", 1)
    try:
        written += corrupt_tag(layout)
        yield resident
    finally:
        resident.end()
        (layout / "index.json").write_bytes(index)
        for blob in written:
            blob.unlink(missing_ok=True)
        node.cluster_chart("up")  # idempotent where the test rolled back: then nothing rolls
        wait_for(lambda: rolled_agent(node), "the agent's pod on the node's values", ROLL_TIMEOUT, every=1)
        node.wait_ready(AGENT, timeout=RECONCILE_TIMEOUT)


def test_a_bad_artifact_holds_the_rollout_on_the_node_and_a_rollback_restores_it(
        node, vm, tmp_path, node_figures):
    # Before: the release rolled out (the agent Ready for minReadySeconds), the class installed.
    code, said = rollout_status(node, f"{MIN_READY_S + 90}s")
    assert code == 0 and "successfully rolled out" in said, said
    ref, files = installed(node)
    assert ref == GOOD and any(name.endswith(CONFIG_LAYER) for name in files), (ref, sorted(files))
    drivers = node.drivers()
    assert all(drivers[bdf] == "vfio-pci" for bdf in vm.gpus), drivers
    old_agent = rolled_agent(node)
    assert old_agent is not None

    # helm upgrade with the class's artifacts on the corrupt tag.
    started = time.monotonic()
    agent = apply_chart(node, values_with(BAD), tmp_path)
    assert agent["metadata"]["uid"] != old_agent["metadata"]["uid"]
    status, why = wait_for(lambda: (r := readyz(agent)) and f"runtime class {KATA_CLASS}: " in r[1] and r,
                           "the new agent's /readyz with the upgrade gate's verdict", RECONCILE_TIMEOUT, every=1)
    held_s = time.monotonic() - started
    assert status == 503 and "the node's Kata artifacts failed verification" in why, why
    assert f"{CLASS_DIR} holds {GOOD}" in why and f"not {BAD} as the config asks" in why, why
    assert "helm rollback" in why, why
    # The kubelet marks the pod unready; its Event carries only the status code ...
    failing = wait_for(lambda: pod_events(node, agent, "Unhealthy"), "the agent's readiness probe failed",
                       PROBE_TIMEOUT, every=1)
    assert any("Readiness probe failed" in e["message"] and "503" in e["message"] for e in failing), failing
    # (The device plugin beside it passes its own probe once it has registered: waited for.)
    ready = wait_for(lambda: (r := containers_ready(node, agent)) and r["sandbox-device-plugin"] and r,
                     "the device plugin's container ready beside the unready agent", PROBE_TIMEOUT, every=1)
    assert ready == {"kata-manager": False, "sandbox-device-plugin": True}, ready
    assert not is_ready(node.pod(agent["metadata"]["name"], RELEASE_NAMESPACE))
    # ... so the agent says which class, and the way back, on the Node.
    unverified = wait_for(lambda: [e for e in node.events("KataArtifactsUnverified") if BAD in e["message"]],
                          "a KataArtifactsUnverified Event naming the bad artifact", 30, every=1)
    assert unverified[-1]["type"] == "Warning" and f"runtime class {KATA_CLASS}: " in unverified[-1]["message"]

    # The rollout is held: the node's one pod is updated and not available, past minReadySeconds.
    held = daemonset(node)
    assert held["status"]["observedGeneration"] >= held["metadata"]["generation"], held["status"]
    counts = {k: held["status"].get(k, 0) for k in ("desiredNumberScheduled", "updatedNumberScheduled",
                                                     "numberReady", "numberAvailable")}
    assert counts == {"desiredNumberScheduled": 1, "updatedNumberScheduled": 1, "numberReady": 0,
                      "numberAvailable": 0}, held["status"]
    code, said = rollout_status(node, f"{MIN_READY_S + 10}s")
    assert code != 0 and "rollout to finish: 0 of 1 updated pods are available" in said, said
    assert not is_ready(node.pod(agent["metadata"]["name"], RELEASE_NAMESPACE))

    # Through it all the Kata pod ran on with its GPU, the old artifacts as installed, the class offered.
    vm.undisturbed()
    assert sorted(vm_devices(node, VM_NAMESPACE, vm.name).functions) == sorted(vm.functions)
    assert node.drivers() == drivers
    assert installed(node) == (GOOD, files)
    assert node.get()["metadata"]["labels"].get(offer_label(KATA_CLASS)) == "true"
    node.wait_resource(GPU_RESOURCE, 8)

    # helm rollback: the previous values; the new pod finds the old artifacts installed.
    started = time.monotonic()
    agent = apply_chart(node, None, tmp_path)
    node.wait_ready(AGENT, timeout=RECONCILE_TIMEOUT)
    ready_s = time.monotonic() - started
    status, why = readyz(agent)
    assert status == 200 and f"Kata artifacts verified ({KATA_CLASS})" in why, why
    code, said = rollout_status(node, f"{MIN_READY_S + 90}s")
    done_s = time.monotonic() - started
    assert code == 0 and "successfully rolled out" in said, said
    vm.undisturbed()
    assert node.drivers() == drivers
    assert installed(node) == (GOOD, files)
    node_figures.append(f"rollout: a corrupt artifact held the agent's rollout {held_s:.1f} s after the re-apply "
                        f"(/readyz naming the class); rollback -> agent Ready {ready_s:.1f} s, rollout complete "
                        f"{done_s:.1f} s (minReadySeconds {MIN_READY_S})")
