"""The local node of tests/node (``hack/local-cluster up --node``): its labels, the chart's
pods on it, their logs and metrics, and pods of the tests' own, all through the real API
server and kubelet.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpunode.host.root import HostRoot
from nodesim import kata_shim
from support import kataoracle
from support.kubecluster import LocalCluster, wait_for
from support.paths import REPO

NODE = "local-node"
NAMESPACE = "gpu-sandbox"  # hack/local-chart's release namespace
NODE_VALUES = REPO / "examples" / "values" / "local-node.yaml"  # hack/local-chart's values with --node
RELEASE = "kata-sandbox-manager"
WEBHOOK_REPLICAS = 3  # the chart's isolation.webhook.replicas
WORKLOAD = "nvidia.com/gpu.workload.config"
GPU_RESOURCE = "nvidia.com/GH100H100_SXM5_80GB"
NVSWITCH_RESOURCE = "nvidia.com/PCI_22a3"  # the dgx-h100 profile's NVSwitch, by PCI id
KATA_CLASS = "kata-qemu-nvidia-gpu"
AGENT = "app.kubernetes.io/component=sandbox-agent"
IMAGE = "ghcr.io/kata-sandbox-manager/kata-sandbox-manager:0.1.0"  # the chart's, from hack/image/build
# A pod's start on this 2-core machine: the kubelet's sync, the sandbox, the container.
POD_TIMEOUT = 120
CONTAINER_GPU = "nvidia.com/gpu"
# The simulated host's emulated kernel settings (nodesim.kernel), in its /sys.
KERNEL_SETTINGS = "sys/katamgr-simulated-host"


@dataclass
class Node:
    cluster: LocalCluster

    # --- the Node object ----------------------------------------------------------------

    def get(self) -> dict[str, Any]:
        return json.loads(self.cluster.kubectl("get", "node", NODE, "-o", "json").stdout)

    def label(self, key: str, value: str | None) -> None:
        self.cluster.kubectl("label", "node", NODE, f"{key}-" if value is None else f"{key}={value}",
                             "--overwrite")

    def resources(self, field: str = "allocatable") -> dict[str, str]:
        return self.get()["status"].get(field, {})

    def wait_resource(self, name: str, count: int, timeout: float = 60) -> dict[str, str]:
        def seen():
            status = self.get()["status"]
            have = (status.get("capacity", {}).get(name), status.get("allocatable", {}).get(name))
            return status if have == (str(count), str(count)) else None
        return wait_for(seen, f"node {NODE}: capacity and allocatable {name}={count}", timeout, every=0.5)

    # --- pods ---------------------------------------------------------------------------

    def pods(self, selector: str, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
        out = self.cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout
        return json.loads(out)["items"]

    def pod(self, name: str, namespace: str) -> dict[str, Any]:
        return json.loads(self.cluster.kubectl("get", "pod", name, "-n", namespace, "-o", "json").stdout)

    def component_pod(self, component: str) -> dict[str, Any]:
        pods = [p for p in self.pods(f"app.kubernetes.io/component={component}")
                if not p["metadata"].get("deletionTimestamp")]
        assert len(pods) == 1, f"{component}: {len(pods)} pods"
        return pods[0]

    def wait_ready(self, selector: str, namespace: str = NAMESPACE, count: int = 1,
                   timeout: float = POD_TIMEOUT) -> list[dict[str, Any]]:
        def ready():
            pods = [p for p in self.pods(selector, namespace) if not p["metadata"].get("deletionTimestamp")]
            good = [p for p in pods if is_ready(p)]
            return good if len(good) == count and len(pods) == count else None
        try:
            return wait_for(ready, f"{count} Ready pod(s) {selector} in {namespace}", timeout, every=1)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.describe(selector, namespace)}") from None

    def wait_chart_ready(self) -> None:
        self.wait_ready("app.kubernetes.io/component=sandbox-agent")
        self.wait_ready("app.kubernetes.io/component=webhook", count=WEBHOOK_REPLICAS)

    def describe(self, selector: str, namespace: str = NAMESPACE) -> str:
        result = self.cluster.kubectl("describe", "pods", "-n", namespace, "-l", selector, check=False)
        events = self.cluster.kubectl("get", "events", "-n", namespace, check=False)
        return (result.stdout + result.stderr)[-6000:] + "\n" + events.stdout[-3000:]

    def logs(self, pod: str, namespace: str, container: str | None = None,
             previous: bool = False) -> str:
        args = ["logs", pod, "-n", namespace] + (["-c", container] if container else [])
        return self.cluster.kubectl(*args, *(["--previous"] if previous else []), check=False).stdout

    def run(self, manifest: dict[str, Any] | str, *, check: bool = True):
        """Create a pod (or anything) as a user would: ``kubectl apply -f``."""
        text = manifest if isinstance(manifest, str) else yaml.safe_dump(manifest, sort_keys=False)
        return self.cluster.kubectl("apply", "-f", "-", input=text, check=check)

    def wait_phase(self, name: str, namespace: str, phases: tuple[str, ...] = ("Running",),
                   timeout: float = POD_TIMEOUT) -> dict[str, Any]:
        def reached():
            pod = self.pod(name, namespace)
            return pod if pod["status"].get("phase") in phases else None
        try:
            return wait_for(reached, f"pod {namespace}/{name} in {'/'.join(phases)}", timeout, every=0.5)
        except AssertionError as e:
            described = self.cluster.kubectl("describe", "pod", name, "-n", namespace, check=False)
            raise AssertionError(f"{e}\n{described.stdout[-5000:]}") from None

    def wait_log(self, name: str, namespace: str, text: str, timeout: float = 60) -> str:
        return wait_for(lambda: (log := self.logs(name, namespace)) and text in log and log,
                        f"{text!r} in the log of {namespace}/{name}", timeout, every=0.5)

    def delete_pod(self, name: str, namespace: str) -> None:
        self.cluster.kubectl("delete", "pod", name, "-n", namespace, "--grace-period", "1",
                             "--ignore-not-found", "--wait=true", timeout=120)

    def cluster_chart(self, command: str, *extra: str) -> str:
        """``hack/local-chart up DIR --node [EXTRA]`` or ``down DIR`` on this cluster."""
        args = [str(REPO / "hack" / "local-chart"), command, str(self.cluster.dir), *extra]
        if command == "up":
            args.append("--node")
        result = subprocess.run(args, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout + result.stderr

    # --- the simulated host ---------------------------------------------------------------

    def drivers(self) -> dict[str, str | None]:
        """Each NVIDIA device's driver (GPUs and NVSwitches), from the host's sysfs."""
        return nvidia_drivers(self.cluster.host_root)

    def kernel(self, **settings: Any) -> None:
        """Tune the simulated host's emulated kernel (``driver_write_ms``...), as its
        docstring says tests may; every process of the node reads it on the next write."""
        path = self.cluster.host_root / KERNEL_SETTINGS
        data = json.loads(path.read_text())
        data.update(settings)
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")

    def events(self, reason: str | None = None) -> list[dict[str, Any]]:
        """The Events on the Node (namespace default, where the kubelet puts them too)."""
        selector = f"involvedObject.kind=Node,involvedObject.name={NODE}"
        if reason:
            selector += f",reason={reason}"
        out = self.cluster.kubectl("get", "events", "-n", "default", "--field-selector", selector,
                                   "-o", "json").stdout
        return json.loads(out)["items"]

    # --- metrics --------------------------------------------------------------------------

    def scrape(self, pod: dict[str, Any], port: int) -> str:
        """/metrics through the pod's own address, as Prometheus scrapes it."""
        url = f"http://{pod['status']['podIP']}:{port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - a pod on this node
            return response.read().decode()


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
    return conditions.get("Ready") == "True"


def metric(text: str, name: str, **labels: str) -> float | None:
    """One sample's value from Prometheus text, or None."""
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric_name, _, label_text = head.partition("{")
        if metric_name != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            return float(value)
    return None


def restart_count(pod: dict[str, Any]) -> int:
    return sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses", []))



def nvidia_drivers(root: Path) -> dict[str, str | None]:
    """BDF -> driver of every NVIDIA PCI function under ``root``'s sysfs."""
    devices = root / "sys/bus/pci/devices"
    found = {}
    for bdf in sorted(os.listdir(devices)):
        try:
            if (devices / bdf / "vendor").read_text().strip() != "0x10de":
                continue
        except OSError:
            continue
        link = devices / bdf / "driver"
        found[bdf] = os.path.basename(os.readlink(link)) if link.is_symlink() else None
    return found


def started_processes(directory: Path) -> dict[int, str]:
    """Processes a local cluster in ``directory`` started, found the way `ps` would: the
    command line names the dir (every component's flags do, and each containerd shim's
    ``-address``), or the process lives in the kubelet's ``kubepods`` cgroups (its pods'
    containers; one node per machine). Other clusters' processes (other checkouts' control
    planes, another containerd's shims) name other dirs. pid -> command line."""
    found = {}
    marks = (str(directory),)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            cgroup = (entry / "cgroup").read_text()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z":
            continue
        if any(m in cmdline for m in marks) or "/kubepods" in cgroup:
            found[int(entry.name)] = cmdline[:200]
    return found



def ask_kata(node: Node, release: str, namespace: str, pod: str) -> kataoracle.Outcome:
    """Kata's own cold-plug on the node: the real kubelet's PodResources, the node's CDI
    specs, and its sysfs (the simulated host's, shown to Kata as /sys)."""
    root = node.cluster.host_root
    return kataoracle.run(release, pod=(namespace, pod), root=root,
                          pod_resources=root / "var/lib/kubelet/pod-resources/kubelet.sock",
                          cdi_dirs=[root / "etc/cdi", root / "var/run/cdi"])


def vm_devices(node: Node, namespace: str, pod: str) -> kata_shim.ColdPlug:
    """What the pod's VM gets, for a test that stands in for its QEMU: the stand-in's answer,
    which Kata's own code (the newest pinned release) must give too, compared as sets (the
    kubelet lists a container's devices in Go map order)."""
    root = node.cluster.host_root
    release = kataoracle.NEWEST
    plug = kata_shim.cold_plug(HostRoot.at(root, runtime_root=str(root)),
                               root / "var/lib/kubelet/pod-resources/kubelet.sock",
                               kata_shim.sandbox_annotations(namespace, pod), release=release)
    kata = ask_kata(node, release, namespace, pod)
    assert kata.ok, f"Kata {release} fails {namespace}/{pod}: {kata.error}"
    assert (sorted(plug.functions), sorted(plug.device_nodes)) == \
        (sorted(kata.plugged), sorted(kata.device_nodes)), (plug, kata)
    return plug
