"""The DRA driver on a simulated DGX H100: claim prepare latency and ResourceSlice republish time.

- prepare: NodePrepareResources for a claim of one GPU, called as kubelet 1.35 calls it
  (grpcio, one claim per call), against the in-process API server stand-in: the claim's
  read, the device re-check, the CDI name and the checkpoint's atomic write (fsync); then
  the same claim again (answered from the checkpoint) and NodeUnprepareResources;
- republish: a GPU's /dev/vfio/<group> node removed (the device turns Unhealthy at the
  first inotify event) or put back (seen by the rescan once the events settle), until the
  stand-in has answered the driver's write of the next pool generation.

Prints figures; asserts nothing. Run: .venv/bin/python bench/bench_dra.py [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
# The API stand-in from tests/support; the repository first, so its cdi package wins over
# the tests' cdi directory.
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from support.apiserver import FakeApiServer  # noqa: E402

from gpunode.host.pciids import PciIds  # noqa: E402
from gpunode.policy.naming import Naming  # noqa: E402
from katamgr.pipeline.reconcile import Steps, reconcile  # noqa: E402
from kubeletapi import dra_pb2 as dra  # noqa: E402
from kubeletapi import dra_pb2_grpc as dra_grpc  # noqa: E402
from nodesim.materialise import materialise  # noqa: E402
from nodesim.profiles import find_profile  # noqa: E402
from sandbox_plugin.dra.driver import DraDriver  # noqa: E402

DRIVER = "passthrough.kata-sandbox-manager.io"
NODE = "dgx-1"


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return f"p50 {statistics.median(ordered):.2f} ms, p99 {p99:.2f} ms, max {ordered[-1]:.2f} ms"


def claim(server: FakeApiServer, name: str, device: str) -> dra.Claim:
    obj = server.seed({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"}, "spec": {},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}]}},
            "reservedFor": [{"resource": "pods", "name": name, "uid": name}]}})
    return dra.Claim(namespace="default", name=name, uid=obj["metadata"]["uid"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200, help="claims prepared (default 200)")
    parser.add_argument("--changes", type=int, default=40, help="device changes (default 40)")
    args = parser.parse_args()
    naming = Naming(PciIds.find())
    with tempfile.TemporaryDirectory(prefix="bd-") as tmp, FakeApiServer() as server:
        host = materialise(find_profile("dgx-h100"), Path(tmp) / "h")
        assert reconcile(host, naming, Steps(), None).ok
        server.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        driver = DraDriver(host, naming, server.client(), driver=DRIVER, node=NODE)
        driver.start()
        try:
            driver.wait_synced(0)
            gpus = sorted(n for n in driver.devices() if n.startswith("gpu-"))
            endpoint = host.path(driver.layout.endpoint)
            prepare, again, unprepare = [], [], []
            with grpc.insecure_channel(f"unix://{endpoint}") as channel:
                stub = dra_grpc.DRAPluginStub(channel)
                for i in range(args.rounds):
                    ref = claim(server, f"c{i}", gpus[i % len(gpus)])
                    request = dra.NodePrepareResourcesRequest(claims=[ref])
                    for samples in (prepare, again):
                        start = time.perf_counter()
                        answer = stub.NodePrepareResources(request, timeout=45)
                        samples.append((time.perf_counter() - start) * 1000)
                        assert not answer.claims[ref.uid].error, answer.claims[ref.uid].error
                    start = time.perf_counter()
                    stub.NodeUnprepareResources(dra.NodeUnprepareResourcesRequest(claims=[ref]), timeout=45)
                    unprepare.append((time.perf_counter() - start) * 1000)
            print(f"host: simulated DGX H100, {len(driver.devices())} DRA devices; {args.rounds} claims of one GPU")
            print(f"NodePrepareResources (claim read, re-check, checkpoint): {percentiles(prepare)}")
            print(f"NodePrepareResources again (from the checkpoint):        {percentiles(again)}")
            print(f"NodeUnprepareResources:                                  {percentiles(unprepare)}")

            republish: dict[str, list[float]] = {"removed": [], "back": []}
            node = host.path("/dev/vfio/6")  # GPU 0000:03:00.0
            aside = host.path("/dev/vfio/.6")
            for i in range(args.changes):
                generation = driver.publisher.generation
                start = time.perf_counter()
                if i % 2 == 0:
                    node.rename(aside)
                else:
                    aside.rename(node)
                # Until the API server answered the write of the next generation (the
                # driver's sync returned), without polling the server.
                with driver.synced:
                    driver.synced.wait_for(lambda g=generation: driver.publisher.generation > g
                                           and driver.last_sync == "updated", timeout=10)
                republish["removed" if i % 2 == 0 else "back"].append((time.perf_counter() - start) * 1000)
            for what, samples in republish.items():
                print(f"/dev/vfio/6 {what:7} to the next slice generation in the API ({len(samples)}x): "
                      f"{percentiles(samples)}")
        finally:
            driver.stop()


if __name__ == "__main__":
    main()
