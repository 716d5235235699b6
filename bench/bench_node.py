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
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from nodeparts import (  # noqa: E402 - beside this script
    BENCH_NS,
    CONTAINER_PLUGIN,
    Drivers,
    NodeWatch,
    Vm,
    allocatable_is,
    apiserver_metrics,
    cdi_written,
    first,
    kata_pod,
    kubelet_metrics,
    last,
    log_lines,
    parse_time,
    plugin_metrics,
    relabel,
    total,
)
from support.kubecluster import LocalCluster, wait_for  # noqa: E402
from support.nodekit import (  # noqa: E402
    AGENT,
    GPU_RESOURCE,
    WORKLOAD,
    Node,
)

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
