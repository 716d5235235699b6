"""The waits a user sees on the real local node, each broken into its parts, beside the
floor the kubelet and the scheduler set.

    flock /tmp/katasm-node.lock .venv/bin/python bench/bench_node.py [--rounds 5]

Needs what tests/node needs (root, the node's Debian parts, the cached builds): starts
``hack/local-cluster up DIR --node`` (the simulated DGX H100: 8 GPUs, 4 NVSwitches), puts
the chart on it (``hack/local-chart up --node``) and, for each round:

1. ``chart``: ``hack/local-chart down`` (the uninstall hooks put every GPU back on
   ``nvidia``: the node as it was before the chart) and ``up`` again on a node labelled
   vm-passthrough: apply -> 8 GPUs and 4 NVSwitches allocatable.
2. ``to-container``: label vm-passthrough -> container: -> 8 ``nvidia.com/gpu`` allocatable.
3. ``to-passthrough``: label container -> vm-passthrough: -> 8 GPUs allocatable.
4. ``round-trip``: two Kata pods whose VMs hold 4 GPUs; label -> container (4 offered),
   the pods end (-> 8 ``nvidia.com/gpu``), label -> vm-passthrough (-> 8 GPUs).
5. ``kata-pod``: a Kata pod asking for 8 GPUs and 4 NVSwitches: created -> its container
   running, with the time spent in our components (the admission webhook, as the API
   server measures it; GetPreferredAllocation and Allocate, as the plugin and the kubelet
   measure them) and in the runtime (the kubelet's runtime operations: the sandbox, the
   container, CDI injection included, its start).

Timestamps: the bench's own (the label's PATCH answered, Node and Pod watch events,
sysfs polled every 2 ms, the CDI specs' mtimes) and the containers' log lines as the
runtime stamped them (``kubectl logs --timestamps``), all from this machine's clock. The
kubelet reports a plugin's change in the Node's allocatable at its next node status sync,
every ``nodeStatusUpdateFrequency`` (10 s by default and on this node; k8s.io/kubernetes
pkg/kubelet/kubelet.go, syncNodeStatus): that wait, 0 to 10 s, is the floor of every
"-> allocatable" figure, and our part ("ours": from the label to the plugin's last
ListAndWatch update) is what a user waits beyond it on average. Prints one table per
figure: the median and the range over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from support.kubecluster import LocalCluster, wait_for  # noqa: E402
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


# --- the figures -------------------------------------------------------------------------


def switch(node: Node, drivers: Drivers, watch: NodeWatch, workload: str) -> dict[str, float]:
    """Relabel and wait for the whole node to be offered; the parts, in seconds after t0."""
    to_container = workload == "container"
    t0 = relabel(node, workload)
    check = allocatable_is(container=8, gpus=0) if to_container else allocatable_is(gpus=8, nvswitches=4)
    done = watch.wait(t0, check)
    root = node.cluster.host_root
    agent = log_lines(node, AGENT, "kata-manager", since=t0 - 1)
    parts = {"seen": first(agent, ": starting", t0)}
    moved = drivers.moves(t0, "nvidia" if to_container else "vfio-pci")
    parts["first device"] = moved[0] if moved else None
    parts["last device"] = moved[-1] if moved else None
    parts["CDI specs"] = cdi_written(root, t0)
    parts["switch logged"] = first(agent, "workload switch", (parts["seen"] or t0) + 1e-6)
    if to_container:
        plugin = log_lines(node, CONTAINER_PLUGIN, since=t0 - 1)
        pods = node.pods(CONTAINER_PLUGIN)
        started = [parse_time(c["state"]["running"]["startedAt"]) for p in pods
                   for c in p["status"].get("containerStatuses", []) if "running" in c.get("state", {})]
        parts["plugin pod created"] = min((parse_time(p["metadata"]["creationTimestamp"]) for p in pods),
                                          default=None)
        parts["plugin started"] = first(plugin, "", t0) if plugin else (min(started) if started else None)
        parts["plugin registered"] = first(plugin, "registered with the kubelet", t0)
        parts["ListAndWatch"] = last(plugin, "GPU(s)", t0)
    else:
        plugin = log_lines(node, AGENT, "sandbox-device-plugin", since=t0 - 1)
        parts["plugin mode"] = first(plugin, "mode vm-passthrough", t0)
        parts["ListAndWatch"] = last(plugin, "appeared", t0) or last(plugin, "device(s)", t0)
    parts["allocatable"] = done
    return {k: (v - t0 if v is not None else None) for k, v in parts.items()}


def chart_up(node: Node, watch: NodeWatch, drivers: Drivers) -> dict[str, float]:
    node.cluster_chart("down")
    wait_for(lambda: not node.pods(AGENT), "the agent's pod gone", 120, every=0.5)
    relabel(node, "vm-passthrough")
    t0 = time.time()
    node.cluster_chart("up")
    applied = time.time()
    done = watch.wait(t0, allocatable_is(gpus=8, nvswitches=4), timeout=240)
    pod = node.wait_ready(AGENT)[0]
    statuses = {c["name"]: c for c in pod["status"]["containerStatuses"]}
    agent = log_lines(node, AGENT, "kata-manager", since=t0)
    plugin = log_lines(node, AGENT, "sandbox-device-plugin", since=t0)
    moved = drivers.moves(t0, "vfio-pci")
    parts = {
        "applied": applied,
        "agent pod created": parse_time(pod["metadata"]["creationTimestamp"]),
        "agent started": parse_time(statuses["kata-manager"]["state"]["running"]["startedAt"]),
        "agent's first line": agent[0][0] if agent else None,
        "first device": moved[0] if moved else None,
        "last device": moved[-1] if moved else None,
        "CDI specs": cdi_written(node.cluster.host_root, t0),
        "reconciled": last(agent, "changed:", t0),
        "plugin started": plugin[0][0] if plugin else None,
        "plugin registered": first(plugin, "registered with the kubelet", t0),
        "ListAndWatch": last(plugin, "appeared", t0) or last(plugin, "device(s)", t0),
        "allocatable": done,
    }
    return {k: (v - t0 if v is not None else None) for k, v in parts.items()}


def round_trip(node: Node, drivers: Drivers, watch: NodeWatch) -> dict[str, float]:
    node.run(kata_pod("holder-a", 2))
    node.run(kata_pod("holder-b", 2))
    vms = []
    for name in ("holder-a", "holder-b"):
        node.wait_phase(name, BENCH_NS)
        vms.append(Vm(node, name))
    t0 = relabel(node, "container")
    # The 4 held GPUs stay listed by the passthrough plugin for their pods (never allocated).
    offered = watch.wait(t0, allocatable_is(container=4, gpus=4))
    ended = time.time()
    for vm in vms:
        vm.end()
    for name in ("holder-a", "holder-b"):
        node.cluster.kubectl("delete", "pod", name, "-n", BENCH_NS, "--grace-period", "1", "--wait=false")
    all_back = watch.wait(ended, allocatable_is(container=8, gpus=0))
    plugin = log_lines(node, CONTAINER_PLUGIN, since=ended)
    given_back = drivers.moves(ended, "nvidia")
    t1 = relabel(node, "vm-passthrough")
    back = watch.wait(t1, allocatable_is(gpus=8, nvswitches=4))
    for name in ("holder-a", "holder-b"):
        node.delete_pod(name, BENCH_NS)
    return {
        "relabel -> 4 offered": offered - t0,
        "VMs end -> last GPU back on nvidia": (given_back[-1] - ended) if given_back else None,
        "VMs end -> ListAndWatch (8)": (last(plugin, "GPU(s)", ended) or ended) - ended,
        "VMs end -> 8 offered": all_back - ended,
        "relabel back -> 8 GPUs": back - t1,
        "round trip": back - t0,
    }


def kata_pod_start(node: Node) -> dict[str, float]:
    from kubernetes import client, watch

    api = client.CoreV1Api(node.cluster.client())
    before = (apiserver_metrics(node), kubelet_metrics(node), plugin_metrics(node))
    seen: dict[str, float] = {}
    stream = watch.Watch()
    done = threading.Event()

    def follow():
        for event in stream.stream(api.list_namespaced_pod, BENCH_NS, field_selector="metadata.name=big",
                                   timeout_seconds=120):
            pod, now = event["object"], time.time()
            if pod.spec.node_name and "scheduled" not in seen:
                seen["scheduled"] = now
            statuses = pod.status.container_statuses or []
            if any(s.state and s.state.running for s in statuses):
                seen["running"] = now
                done.set()
                stream.stop()
    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    time.sleep(0.5)  # the watch is open
    t0 = time.time()
    api.create_namespaced_pod(BENCH_NS, kata_pod("big", 8, 4))
    created = time.time()
    if not done.wait(180):
        raise TimeoutError(f"pod big not running: {seen}")
    after = (apiserver_metrics(node), kubelet_metrics(node), plugin_metrics(node))
    node.delete_pod("big", BENCH_NS)

    def delta(i: int, name: str, **labels: str) -> float:
        return total(after[i], name, **labels) - total(before[i], name, **labels)
    webhook = delta(0, "apiserver_admission_webhook_admission_duration_seconds_sum")
    policy = delta(0, "apiserver_validating_admission_policy_check_duration_seconds_sum")
    preferred = delta(2, "sandbox_device_plugin_preferred_allocation_duration_seconds_sum")
    allocate = delta(2, "sandbox_device_plugin_allocate_duration_seconds_sum")
    kubelet_alloc = delta(1, "kubelet_device_plugin_alloc_duration_seconds_sum")
    runtime = {op: delta(1, "kubelet_runtime_operations_duration_seconds_sum", operation_type=op)
               for op in ("run_podsandbox", "create_container", "start_container")}
    wait = seen["running"] - t0
    ours = webhook + preferred + allocate
    return {
        "create answered (admission)": created - t0,
        "  webhook calls (API server's measure)": webhook,
        "  admission policy (CEL, in the API server)": policy,
        "scheduled": seen["scheduled"] - t0,
        "GetPreferredAllocation (plugin)": preferred,
        "Allocate (plugin)": allocate,
        "Allocate (kubelet's measure, RPC included)": kubelet_alloc,
        "runtime: sandbox": runtime["run_podsandbox"],
        "runtime: create (CDI injection included)": runtime["create_container"],
        "runtime: start": runtime["start_container"],
        "running": wait,
        "ours (webhook + preferred + Allocate)": ours,
        "ours, share of the wait (%)": 100 * ours / wait,
    }


# --- the report ------------------------------------------------------------------------


def table(title: str, rounds: list[dict[str, float | None]]) -> None:
    print(f"\n{title} ({len(rounds)} rounds; seconds after the start unless said)")
    keys = list(dict.fromkeys(k for r in rounds for k in r))
    width = max(len(k) for k in keys)
    print(f"  {'part':{width}}  {'median':>8}  {'min':>8}  {'max':>8}")
    for key in keys:
        values = [r[key] for r in rounds if r.get(key) is not None]
        if not values:
            print(f"  {key:{width}}  {'-':>8}")
            continue
        print(f"  {key:{width}}  {statistics.median(values):8.3f}  {min(values):8.3f}  {max(values):8.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", nargs="*", default=["chart", "switch", "round-trip", "kata-pod"])
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="ksm-bench-", dir="/tmp"))
    started = time.monotonic()
    cluster = LocalCluster.up(directory / "c", node=True)
    print(f"node up in {cluster.start_seconds:.0f} s")
    node = Node(cluster)
    results: dict[str, list] = {"chart": [], "to-container": [], "to-passthrough": [],
                                "round-trip": [], "kata-pod": []}
    try:
        node.label(WORKLOAD, "vm-passthrough")
        node.cluster_chart("up")
        node.wait_chart_ready()
        cluster.namespace(BENCH_NS)
        drivers = Drivers(cluster.host_root)
        drivers.start()
        watch = NodeWatch(cluster)
        watch.start()
        node.wait_resource(GPU_RESOURCE, 8, timeout=120)
        for i in range(args.rounds):
            if "chart" in args.only:
                results["chart"].append(chart_up(node, watch, drivers))
            if "switch" in args.only:
                results["to-container"].append(switch(node, drivers, watch, "container"))
                results["to-passthrough"].append(switch(node, drivers, watch, "vm-passthrough"))
            if "round-trip" in args.only:
                results["round-trip"].append(round_trip(node, drivers, watch))
            if "kata-pod" in args.only:
                results["kata-pod"].append(kata_pod_start(node))
            print(f"round {i + 1} done ({time.monotonic() - started:.0f} s)", flush=True)
    finally:
        print(cluster.down())
        subprocess.run(["rm", "-rf", str(directory)], check=False)
    titles = {
        "chart": "hack/local-chart up --node on a node without the chart -> 8 GPUs + 4 NVSwitches allocatable",
        "to-container": "label vm-passthrough -> container: -> 8 nvidia.com/gpu allocatable",
        "to-passthrough": "label container -> vm-passthrough: -> 8 GPUs allocatable",
        "round-trip": "relabel round trip with VMs holding 4 GPUs",
        "kata-pod": "a Kata pod with 8 GPUs and 4 NVSwitches: created -> running (times are durations)",
    }
    for key, rounds in results.items():
        if rounds:
            table(titles[key], rounds)
    print("\nraw:", json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
