"""What bench_node.py watches and does on the real local node: the GPUs' drivers and the
Node's allocatable as they change (threads that time-stamp each change), the components'
logs and metrics, a relabel, a Kata pod and its VM stand-in."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from support.kubecluster import LocalCluster  # noqa: E402
from support.nodekit import (  # noqa: E402
    AGENT,
    CONTAINER_GPU,
    GPU_RESOURCE,
    IMAGE,
    KATA_CLASS,
    NAMESPACE,
    NVSWITCH_RESOURCE,
    WORKLOAD,
    Node,
    nvidia_drivers,
    vm_devices,
)

CONTAINER_PLUGIN = "app.kubernetes.io/component=device-plugin"
BENCH_NS = "bench-node"
KUBELET_SYNC = 10.0  # nodeStatusUpdateFrequency on the local node (the kubelet's default)
STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)(Z|[+-]\d\d:\d\d) (.*)$")


def parse_time(text: str) -> float:
    """RFC 3339 (nanoseconds allowed) -> Unix time."""
    match = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", text)
    if not match:
        raise ValueError(text)
    base, fraction, zone = match.groups()
    stamp = datetime.fromisoformat(base + ("+00:00" if zone == "Z" else zone)).timestamp()
    return stamp + (float(f"0.{fraction}") if fraction else 0.0)


# --- observers ------------------------------------------------------------------------


class Drivers(threading.Thread):
    """The NVIDIA devices' drivers, read every 2 ms: (time, bdf, driver) per change."""

    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.links = {bdf: root / "sys/bus/pci/devices" / bdf / "driver" for bdf in nvidia_drivers(root)}
        self.changes: list[tuple[float, str, str | None]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        last: dict[str, str | None] = {}
        while not self.stop.wait(0.002):
            now = time.time()
            for bdf, link in self.links.items():
                try:
                    driver = os.path.basename(os.readlink(link))
                except OSError:
                    driver = None
                if last.get(bdf, "?") != driver:
                    if bdf in last:
                        self.changes.append((now, bdf, driver))
                    last[bdf] = driver

    def moves(self, since: float, driver: str) -> list[float]:
        return [t for t, _, d in self.changes if t >= since and d == driver]


class NodeWatch(threading.Thread):
    """The Node's status as the API server sends it: (time, allocatable) per event."""

    def __init__(self, cluster: LocalCluster) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.events: list[tuple[float, dict]] = []
        self.cond = threading.Condition()

    def run(self) -> None:
        from kubernetes import client, watch

        api = client.CoreV1Api(self.cluster.client())
        while True:
            try:
                for event in watch.Watch().stream(api.list_node, field_selector="metadata.name=local-node",
                                                  timeout_seconds=300, _request_timeout=330):
                    status = event["object"].status
                    with self.cond:
                        self.events.append((time.time(), dict(status.allocatable or {})))
                        self.cond.notify_all()
            except Exception:  # noqa: BLE001 - the API server restarting: watch again
                time.sleep(0.2)

    def wait(self, since: float, check, timeout: float = 120) -> float:
        """The time of the first event after ``since`` whose allocatable passes ``check``."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for t, allocatable in self.events:
                    if t >= since and check(allocatable):
                        return t
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"allocatable never passed the check; last {self.events[-1:]}")
                self.cond.wait(left)


def allocatable_is(**wanted: int):
    names = {"gpus": GPU_RESOURCE, "nvswitches": NVSWITCH_RESOURCE, "container": CONTAINER_GPU}

    def check(allocatable: dict) -> bool:
        return all(int(allocatable.get(names[k], "0")) == v for k, v in wanted.items())
    return check


# --- the node's logs and metrics -----------------------------------------------------


def log_lines(node: Node, selector: str, container: str | None = None, since: float = 0.0,
              namespace: str = NAMESPACE) -> list[tuple[float, str]]:
    """(time, line) of the running pods' logs, as the runtime stamped them."""
    out = []
    for pod in node.pods(selector, namespace):
        if pod["metadata"].get("deletionTimestamp"):
            continue
        args = ["logs", pod["metadata"]["name"], "-n", namespace, "--timestamps"]
        if container:
            args += ["-c", container]
        text = node.cluster.kubectl(*args, check=False).stdout
        for line in text.splitlines():
            match = STAMP.match(line)
            if match:
                t = parse_time(match.group(1) + match.group(2))
                if t >= since:
                    out.append((t, match.group(3)))
    return sorted(out)


def first(lines: list[tuple[float, str]], text: str, after: float = 0.0) -> float | None:
    return next((t for t, line in lines if text in line and t >= after), None)


def last(lines: list[tuple[float, str]], text: str, after: float = 0.0) -> float | None:
    found = [t for t, line in lines if text in line and t >= after]
    return found[-1] if found else None


def scrape_families(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == want for k, want in labels.items()))


def apiserver_metrics(node: Node) -> dict:
    return scrape_families(node.cluster.kubectl("get", "--raw", "/metrics", timeout=60).stdout)


def kubelet_metrics(node: Node) -> dict:
    return scrape_families(node.cluster.kubectl("get", "--raw", "/api/v1/nodes/local-node/proxy/metrics",
                                                timeout=60).stdout)


def plugin_metrics(node: Node) -> dict:
    return scrape_families(node.scrape(node.wait_ready(AGENT)[0], 9411))


# --- the node's actions ----------------------------------------------------------------


def relabel(node: Node, workload: str) -> float:
    """Patch the label; the time the API server answered."""
    from kubernetes import client

    api = client.CoreV1Api(node.cluster.client())
    api.patch_node("local-node", {"metadata": {"labels": {WORKLOAD: workload}}})
    return time.time()


def cdi_written(root: Path, since: float) -> float | None:
    spec_dir = root / "var/run/cdi"
    times = [p.stat().st_mtime for p in spec_dir.glob("nvidia.com-*")] + [spec_dir.stat().st_mtime]
    later = [t for t in times if t >= since]
    return max(later) if later else None


def kata_pod(name: str, gpus: int, nvswitches: int = 0) -> dict:
    limits = {GPU_RESOURCE: str(gpus), **({NVSWITCH_RESOURCE: str(nvswitches)} if nvswitches else {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": BENCH_NS},
            "spec": {"runtimeClassName": KATA_CLASS, "restartPolicy": "Never",
                     "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": IMAGE, "imagePullPolicy": "Never",
                                     "command": ["sleep", "3600"], "resources": {"limits": limits}}]}}


class Vm:
    """A Kata pod's QEMU holding its groups, in the simulated host's /proc."""

    pids = iter(range(910_000, 911_000))

    def __init__(self, node: Node, name: str) -> None:
        root = node.cluster.host_root
        plug = vm_devices(node, BENCH_NS, name)
        self.node, self.name, self.pid = node, name, next(self.pids)
        self.dir = root / f"proc/{self.pid}"
        (self.dir / "fd").mkdir(parents=True)
        (self.dir / "comm").write_text("qemu-system-x86\n")
        for i, path in enumerate(n for n in plug.device_nodes if n != "/dev/vfio/vfio"):
            (self.dir / "fd" / str(20 + i)).symlink_to(path)

    def end(self) -> None:
        for link in (self.dir / "fd").iterdir():
            link.unlink()
        (self.dir / "fd").rmdir()
        (self.dir / "comm").unlink()
        self.dir.rmdir()
