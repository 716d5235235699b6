"""N sandbox agents following their Nodes on a real API server: the load at rest and a
relabel of every node at once.

    .venv/bin/python bench/bench_scale.py [--agents 100] [--rest 330] [--kubeconfig FILE]

Starts a local control plane (hack/local-cluster up, in a temp dir) unless --kubeconfig
names one, applies the chart's ServiceAccount and RBAC, creates --agents Node objects
labelled vm-passthrough, and starts one follower per Node in this process: katamgr's own
Node watch (gpunode.services.kube.NodeLabelWatch, with the agent's settings: 1,800 s watch
requests, bookmarks, at least 1 s between watch starts), each with its own API client and
connection and the agent's ServiceAccount token, as separate agents would have. Then:

1. At rest for --rest seconds (shorter than one 1,800 s watch period by default): the API
   requests they make, from the API server's own apiserver_request_total for nodes
   (watches and gets), as requests per agent per hour.
2. A relabel of every Node to container at once (one PATCH per node from 8 threads, as
   an operator's script or a GitOps sync would): the time until every follower has seen
   its Node's new label, and the API server's request rate and PATCH latency (p50/p99
   from apiserver_request_duration_seconds) meanwhile.

The host-side switch each agent then performs (GPUs back to their drivers) is local to
each node and measured by bench/bench_reconcile.py; it adds no API requests beyond one
Event per node.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from support.chartkit import render_release  # noqa: E402
from support.kubecluster import LocalCluster  # noqa: E402

from gpunode.services.kube import NodeLabelWatch  # noqa: E402

RELEASE = "ksm-scale"
WORKLOAD = "nvidia.com/gpu.workload.config"
ACCOUNT_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


def metrics(kube: LocalCluster) -> list:
    text = kube.kubectl("get", "--raw", "/metrics", timeout=60).stdout
    return list(text_string_to_metric_families(text))


def requests_total(families, resource: str | None = None) -> dict[str, float]:
    """verb -> count of apiserver_request_total (for one resource, or all)."""
    out: dict[str, float] = {}
    for family in families:
        if family.name != "apiserver_request":
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            if resource and sample.labels.get("resource") != resource:
                continue
            verb = sample.labels.get("verb", "")
            out[verb] = out.get(verb, 0.0) + sample.value
    return out


def patch_buckets(families) -> dict[float, float]:
    """le -> cumulative count of apiserver_request_duration_seconds for PATCH nodes."""
    out: dict[float, float] = {}
    for family in families:
        if family.name != "apiserver_request_duration_seconds":
            continue
        for sample in family.samples:
            labels = sample.labels
            if (sample.name.endswith("_bucket") and labels.get("verb") == "PATCH"
                    and labels.get("resource") == "nodes"):
                le = math.inf if labels["le"] == "+Inf" else float(labels["le"])
                out[le] = out.get(le, 0.0) + sample.value
    return out


def quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The bucket bound the q-quantile of the requests between two scrapes falls in."""
    delta = sorted((le, after.get(le, 0.0) - before.get(le, 0.0)) for le in after)
    total = delta[-1][1] if delta else 0.0
    for le, count in delta:
        if total and count >= q * total:
            return le
    return math.nan


class Follower:
    def __init__(self, kube: LocalCluster, kubeconfig: Path, node: str) -> None:
        self.node = node
        self.seen: dict[str, float] = {}
        self.requests: list[str] = []  # "GET path", one per request this agent sent
        client = kube.client(kubeconfig)
        send = client.rest_client.request

        def counted(method, url, *a, **kw):
            self.requests.append(f"{method} {url.split('?')[0]}")
            return send(method, url, *a, **kw)

        client.rest_client.request = counted
        self.watch = NodeLabelWatch(client, node, on_change=self._changed)

    def _changed(self) -> None:
        try:
            value = self.watch.labels().get(WORKLOAD, "")
        except Exception:  # noqa: BLE001 - a failed read is not a label
            return
        self.seen.setdefault(value, time.monotonic())


def on_cluster(parser: argparse.ArgumentParser, prefix: str, run) -> int:
    """The API-server benches' common flags (--rest, --kubeconfig) parsed, then ``run(kube, args,
    tmp)`` on the cluster given, or on one started for it and stopped after."""
    parser.add_argument("--rest", type=float, default=330.0,
                        help="seconds at rest (default 330)")
    parser.add_argument("--kubeconfig", type=Path,
                        help="an existing hack/local-cluster's DIR/kubeconfig (default: start one)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    kube = LocalCluster(args.kubeconfig.parent) if args.kubeconfig else LocalCluster.up(tmp / "cluster")
    try:
        return run(kube, args, tmp)
    finally:
        if not args.kubeconfig:
            kube.down()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=100)
    return on_cluster(parser, "bench-scale-", run)


def run(kube: LocalCluster, args, tmp: Path) -> int:
    objects = render_release({"sandboxWorkloads": {"enabled": True}}, RELEASE)
    accounts = [o for o in objects if o["kind"] in ACCOUNT_KINDS
                and "helm.sh/hook" not in o["metadata"].get("annotations", {})]
    kube.namespace(RELEASE)
    kube.apply(accounts, namespace=RELEASE)
    account = next(o for o in accounts if o["kind"] == "ServiceAccount"
                   and o["metadata"]["name"].endswith("-sandbox-agent"))["metadata"]["name"]
    kubeconfig = kube.service_account_kubeconfig(RELEASE, account, tmp / "agent.kubeconfig")
    nodes = [f"scale-{i:04d}" for i in range(args.agents)]
    kube.apply([{"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": n, "labels": {WORKLOAD: "vm-passthrough", "bench": RELEASE}}} for n in nodes],
        manager="bench")

    started = time.monotonic()
    followers = [Follower(kube, kubeconfig, n) for n in nodes]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda f: f.watch.start(), followers))
    print(f"{args.agents} agents following their Nodes after {time.monotonic() - started:.1f} s")

    # Counted as each agent sends them (the API server's own counter has the controller
    # manager's Node requests in it too, and counts a watch only when it ends).
    sent_before = sum(len(f.requests) for f in followers)
    time.sleep(args.rest)
    sent = sum(len(f.requests) for f in followers) - sent_before
    per_hour = sent / args.agents * 3600 / args.rest
    print(f"at rest for {args.rest:.0f} s: {sent} requests from {args.agents} agents -> "
          f"{per_hour:.1f} requests per agent per hour in this window (each a Node watch renewed "
          f"after its timeoutSeconds)")

    families = metrics(kube)
    all_before, buckets_before = requests_total(families), patch_buckets(families)
    relabel_start = time.monotonic()

    from kubernetes.client import CoreV1Api

    admin = CoreV1Api(kube.client())
    done: dict[str, float] = {}

    def relabel(node: str) -> None:
        admin.patch_node(node, {"metadata": {"labels": {WORKLOAD: "container"}}})
        done[node] = time.monotonic()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(relabel, nodes))
    patched = time.monotonic() - relabel_start
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all("container" in f.seen for f in followers):
        time.sleep(0.05)
    window = time.monotonic() - relabel_start
    families = metrics(kube)
    all_after, buckets_after = requests_total(families), patch_buckets(families)
    missing = [f.node for f in followers if "container" not in f.seen]
    lags = sorted(f.seen["container"] - relabel_start for f in followers if "container" in f.seen)
    # From each PATCH's answer to its agent seeing the label: the watch's own delay.
    delays = sorted(max(0.0, f.seen["container"] - done[f.node]) for f in followers
                    if "container" in f.seen)
    rate = (sum(all_after.values()) - sum(all_before.values())) / window
    print(f"relabel of {args.agents} nodes: all PATCHes done in {patched:.2f} s; every agent "
          f"had seen its label after {lags[-1] if lags else math.nan:.2f} s "
          f"(median {lags[len(lags) // 2] if lags else math.nan:.2f} s)"
          + (f"; {len(missing)} never saw it: {missing[:5]}" if missing else ""))
    if delays:
        print(f"from each node's PATCH answered to its agent seeing it: median "
              f"{delays[len(delays) // 2] * 1000:.0f} ms, max {delays[-1] * 1000:.0f} ms")
    print(f"API server meanwhile: {rate:.0f} requests/s in all; PATCH nodes latency p50 <= "
          f"{quantile(buckets_before, buckets_after, 0.5) * 1000:.0f} ms, p99 <= "
          f"{quantile(buckets_before, buckets_after, 0.99) * 1000:.0f} ms (histogram bucket bounds)")

    for f in followers:
        threading.Thread(target=f.watch.stop, daemon=True).start()
    kube.kubectl("delete", "nodes", "-l", f"bench={RELEASE}", "--wait=false", timeout=120)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
