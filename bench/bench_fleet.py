"""A fleet of N sandbox agents on a real API server: everything an agent pod says to the API,
at rest, through a fleet-wide relabel and through a rollout of every agent.

    .venv/bin/python bench/bench_fleet.py [--nodes 1000] [--rest 330] [--kubeconfig FILE]

Starts a local control plane (hack/local-cluster up, in a temp dir) unless --kubeconfig names
one, applies the chart's ServiceAccount and RBAC (dra.enabled), creates --nodes Node objects
labelled vm-passthrough, and runs one lightweight agent pod per Node in this process, each with
the pod's token and two API clients with their own connections, as the pod's two processes have:

- katamgr run: its Node watch (``gpunode.services.kube.NodeLabelWatch``, the agent's settings),
  its offer label (``katamgr.cluster.set_node_labels``), its Node conditions read at start and
  patched on ``nodes/status`` only on a change (``katamgr.cluster.conditions``), its Events
  (``katamgr.cluster.EventRecorder``: correlated, rate-limited);
- the DRA driver: its own Node watch and the node's ResourceSlice
  (``sandbox_plugin.dra.slices.SlicePublisher``: 8 GPUs offered on vm-passthrough, none
  otherwise).

What the agent does on the host (binding, give-back) is local and measured by
bench/bench_reconcile.py; here a switch is the API writes it makes. Phases:

1. start: every pod starts (a first install);
2. at rest for --rest seconds (default 330: five of the server's bookmarks on every watch);
3. relabel: every Node to ``container`` at once (8 writers, as a GitOps sync would), each pod
   following: conditions patched, a ``WorkloadSwitched`` Event, the slice deleted;
4. rollout: every pod replaced by a new one (new connections, new watches, conditions read back,
   the slice listed), as a DaemonSet rollout does; here all at once, a worst case of maxUnavailable;
5. relabel back to ``vm-passthrough`` (slices created again).

For each: the requests per node (counted as each client sends them), the API server's mutating
latency p99 (POST, PUT, PATCH, DELETE, from its own apiserver_request_duration_seconds; the
Kubernetes API call latency SLO) and its resident memory, and the time until every node converged.
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from bench_scale import metrics, on_cluster, requests_total  # noqa: E402
from support.chartkit import render_release  # noqa: E402
from support.kubecluster import LocalCluster  # noqa: E402

from gpunode.services.kube import WATCH_TIMEOUT, NodeLabelWatch  # noqa: E402
from katamgr.cluster import EventRecorder, set_node_labels  # noqa: E402
from katamgr.cluster.conditions import patch_node_conditions, read_node_conditions  # noqa: E402
from sandbox_plugin.dra.devices import DraDevice  # noqa: E402
from sandbox_plugin.dra.slices import SlicePublisher  # noqa: E402

RELEASE = "ksm-fleet"
WORKLOAD = "nvidia.com/gpu.workload.config"
OFFER = "runtimeclass.kata-sandbox-manager.io/kata-qemu-nvidia-gpu"
DRIVER = "gpu.sandbox.kata-sandbox-manager.io"
ACCOUNT_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
MUTATING = ("POST", "PUT", "PATCH", "DELETE")
GPUS = 8


def gpus(node: str) -> list[DraDevice]:
    return [DraDevice(f"gpu-{i}", f"0000:{i + 1:02x}:00.0", "nvidia.com/pgpu", True,
                      (("productName", "NVIDIA H100 80GB HBM3"), ("pciAddress", f"0000:{i + 1:02x}:00.0")))
            for i in range(GPUS)]


def conditions_for(mode: str) -> list[dict[str, str]]:
    bound = mode == "vm-passthrough"
    return [{"type": "SandboxGPUsReady", "status": "True",
             "reason": "GPUsBound" if bound else "NoGPUsWanted",
             "message": f"{GPUS} GPUs on vfio-pci" if bound else f"workload {mode}: no GPU on vfio-pci"},
            {"type": "SandboxRuntimeClassesReady", "status": "True", "reason": "RuntimeClassesReady",
             "message": "kata-qemu-nvidia-gpu"}]


class Counted:
    """An API client of the pod's token whose requests are counted as they are sent."""

    def __init__(self, kube: LocalCluster, kubeconfig: Path) -> None:
        self.sent = 0
        self.api = kube.client(kubeconfig)
        send = self.api.rest_client.request

        def counted(*args, **kwargs):
            self.sent += 1
            return send(*args, **kwargs)

        self.api.rest_client.request = counted


class Pod:
    """One agent pod: katamgr run and the DRA driver, each with its own client and watch."""

    def __init__(self, kube: LocalCluster, kubeconfig: Path, node: str) -> None:
        self.node = node
        self.agent, self.driver = Counted(kube, kubeconfig), Counted(kube, kubeconfig)
        self.events = EventRecorder(self.agent.api, node)
        self.slices = SlicePublisher(self.driver.api, DRIVER, node)
        self.written: dict[str, dict[str, str]] = {}
        self.mode = {"agent": "", "driver": ""}
        self.done: dict[str, float] = {}  # mode -> when both processes had carried it out
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self.watch = NodeLabelWatch(self.agent.api, node, on_change=lambda: self._follow("agent"))
        self.driver_watch = NodeLabelWatch(self.driver.api, node, on_change=lambda: self._follow("driver"))

    @property
    def sent(self) -> int:
        return self.agent.sent + self.driver.sent

    def start(self) -> None:
        self.watch.start()
        self.driver_watch.start()
        self.written = read_node_conditions(self.agent.api, self.node, ["SandboxGPUsReady",
                                                                        "SandboxRuntimeClassesReady"])
        if self.watch.labels().get(OFFER) != "true":
            set_node_labels(self.agent.api, self.node, {OFFER: "true"})
        self._follow("agent")
        self._follow("driver")

    def _follow(self, process: str) -> None:
        watch = self.watch if process == "agent" else self.driver_watch
        try:
            mode = watch.labels().get(WORKLOAD, "")
        except Exception:  # noqa: BLE001 - a failed read is not a label
            return
        with self._lock:
            if mode == self.mode[process] or not mode:
                return
            first = not self.mode[process]
            self.mode[process] = mode
        try:
            if process == "agent":
                self._agent_switch(mode, first)
            else:
                self.slices.sync(gpus(self.node) if mode == "vm-passthrough" else [], verify=first)
        except Exception as exc:  # noqa: BLE001 - counted and shown, as the agent logs them
            self.errors.append(f"{process}: {exc}")
            return
        with self._lock:
            if self.mode["agent"] == self.mode["driver"] == mode:
                self.done.setdefault(mode, time.monotonic())

    def _agent_switch(self, mode: str, first: bool) -> None:
        wanted = conditions_for(mode)
        changed = [c for c in wanted if {k: self.written.get(c["type"], {}).get(k) for k in c} != c]
        if changed:  # as the agent: written only on a change, each with its heartbeat
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            body = [{**c, "lastHeartbeatTime": now, "lastTransitionTime": now} for c in changed]
            patch_node_conditions(self.agent.api, self.node, body)
            self.written.update({c["type"]: c for c in body})
        if first:
            self.events.record("Reconciled", f"node {self.node} ready for {mode}")
        else:
            self.events.record("WorkloadSwitched", f"workload {mode}", limited=False)

    def stop(self) -> None:
        for watch in (self.watch, self.driver_watch):
            threading.Thread(target=watch.stop, daemon=True).start()


def durations(families, verbs=MUTATING) -> dict[float, float]:
    """le -> cumulative count of apiserver_request_duration_seconds over ``verbs``."""
    out: dict[float, float] = {}
    for family in families:
        if family.name != "apiserver_request_duration_seconds":
            continue
        for s in family.samples:
            if s.name.endswith("_bucket") and s.labels.get("verb") in verbs:
                le = math.inf if s.labels["le"] == "+Inf" else float(s.labels["le"])
                out[le] = out.get(le, 0.0) + s.value
    return out


def quantile(before: dict[float, float], after: dict[float, float], q: float) -> tuple[float, int]:
    """The bucket bound the q-quantile of the requests between two scrapes falls in, and their count."""
    delta = sorted((le, after.get(le, 0.0) - before.get(le, 0.0)) for le in after)
    total = delta[-1][1] if delta else 0.0
    for le, count in delta:
        if total and count >= q * total:
            return le, int(total)
    return math.nan, 0


def rss(families) -> float:
    for family in families:
        if family.name == "process_resident_memory_bytes":
            return family.samples[0].value
    return math.nan


class Phase:
    """One phase's figures: requests sent, the API server's histogram and memory before/after."""

    def __init__(self, kube: LocalCluster, pods: list[Pod]) -> None:
        self.kube, self.pods = kube, pods
        families = metrics(kube)
        self.before = durations(families)
        self.server_before = sum(requests_total(families).values())
        self.sent = sum(p.sent for p in pods)
        self.started = time.monotonic()

    def report(self, name: str, converged: float | None = None, extra_sent: int = 0) -> None:
        elapsed = time.monotonic() - self.started
        families = metrics(self.kube)
        sent = sum(p.sent for p in self.pods) - self.sent + extra_sent
        p99, count = quantile(self.before, durations(families), 0.99)
        p50, _ = quantile(self.before, durations(families), 0.5)
        server = sum(requests_total(families).values()) - self.server_before
        n = len({p.node for p in self.pods})
        line = (f"{name}: {sent} requests from {n} nodes ({sent / n:.1f} per node) in {elapsed:.1f} s; "
                f"API server: {server:.0f} requests in all, {count} mutating with p50 <= {p50 * 1000:.0f} ms, "
                f"p99 <= {p99 * 1000:.0f} ms (bucket bounds), RSS {rss(families) / 2**20:.0f} MiB")
        if converged is not None:
            line += f"; every node converged after {converged:.1f} s"
        print(line, flush=True)


def converge(pods: list[Pod], mode: str, since: float, limit: float = 300.0) -> float | None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and not all(mode in p.done for p in pods):
        time.sleep(0.05)
    late = [p.node for p in pods if mode not in p.done]
    if late:
        print(f"  {len(late)} nodes never converged to {mode}: {late[:5]}", flush=True)
        return None
    return max(p.done[mode] for p in pods) - since


def relabel(kube: LocalCluster, pods: list[Pod], mode: str) -> float | None:
    from kubernetes.client import CoreV1Api

    admin = CoreV1Api(kube.client())
    phase = Phase(kube, pods)
    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: admin.patch_node(p.node, {"metadata": {"labels": {WORKLOAD: mode}}}), pods))
    took = converge(pods, mode, started)
    phase.report(f"relabel to {mode} (PATCHes done in {time.monotonic() - started:.1f} s)", took)
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    return on_cluster(parser, "bench-fleet-", run)


def run(kube: LocalCluster, args, tmp: Path) -> int:
    objects = render_release({"sandboxWorkloads": {"enabled": True}, "dra": {"enabled": True}}, RELEASE)
    accounts = [o for o in objects if o["kind"] in ACCOUNT_KINDS
                and "helm.sh/hook" not in o["metadata"].get("annotations", {})]
    kube.namespace(RELEASE)
    kube.apply(accounts, namespace=RELEASE)
    account = next(o for o in accounts if o["kind"] == "ServiceAccount"
                   and o["metadata"]["name"].endswith("-sandbox-agent"))["metadata"]["name"]
    kubeconfig = kube.service_account_kubeconfig(RELEASE, account, tmp / "agent.kubeconfig")
    nodes = [f"fleet-{i:04d}" for i in range(args.nodes)]
    for i in range(0, len(nodes), 200):
        kube.apply([{"apiVersion": "v1", "kind": "Node", "metadata": {
            "name": n, "labels": {WORKLOAD: "vm-passthrough", "bench": RELEASE}}} for n in nodes[i:i + 200]],
            manager="bench")

    pods = [Pod(kube, kubeconfig, n) for n in nodes]
    phase = Phase(kube, pods)
    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda p: p.start(), pods))
    phase.report("start (a first install)", converge(pods, "vm-passthrough", started))

    phase = Phase(kube, pods)
    time.sleep(args.rest)
    sent = sum(p.sent for p in pods) - phase.sent
    phase.report(f"at rest for {args.rest:.0f} s")
    renewals = 2 * 3600 / WATCH_TIMEOUT
    print(f"  at rest: {sent / args.nodes * 3600 / args.rest:.1f} requests per node per hour in this window; "
          f"the pod's two Node watches are renewed once per {WATCH_TIMEOUT} s timeoutSeconds each, "
          f"{renewals:.0f} requests per node per hour (a window shorter than that sees none of them; "
          "anything else seen here is a write at rest or a silent stream resumed)", flush=True)

    relabel(kube, pods, "container")

    # The rollout: each pod replaced by a new one, its first requests those of a start.
    old = pods
    phase = Phase(kube, old)
    for p in old:
        p.stop()
    pods = [Pod(kube, kubeconfig, n) for n in nodes]
    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda p: p.start(), pods))
    phase.pods = pods
    phase.sent = 0
    phase.report("rollout of every pod (all at once)", converge(pods, "container", started),
                 extra_sent=0)

    relabel(kube, pods, "vm-passthrough")
    errors = [e for p in pods + old for e in p.errors]
    if errors:
        print(f"{len(errors)} API errors, e.g. {errors[:3]}")
    for p in pods:
        p.stop()
    kube.kubectl("delete", "nodes", "-l", f"bench={RELEASE}", "--wait=false", timeout=300)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
