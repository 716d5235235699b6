"""Peak memory of every container the chart runs, each doing its job: the figures behind the
memory limits in deploy/helm/kata-sandbox-manager/values.yaml.

    .venv/bin/python bench/bench_memory.py

Each container's command runs here as its own process, on a simulated DGX H100 where it
needs a node, and its peak resident memory is read from /proc (VmHWM, sampled every 10 ms
until it exits or is stopped):

- kata-manager: ``katamgr apply`` installing a Kata runtime class from an OCI layout with
  a 256 MiB guest image (real artifacts are a few hundred MiB; the install streams them),
  binding the GPUs and writing the CDI specs; then ``katamgr run --once`` against the API
  server stand-in (the Kubernetes client loaded, RuntimeClasses applied);
- revert (the uninstall's init container): ``katamgr revert`` of that node;
- sandbox-device-plugin: ``sandbox-device-plugin --workload vm-passthrough --metrics-address``
  registered with the kubelet stand-in, 2,000 Allocates through grpcio and 100 callers for
  4 s, then the worst hostile client for memory (tests/plugin/hostile.py large_bodies:
  requests up to the buffer limits);
- device-plugin: ``sandbox-device-plugin --workload container`` (NVML's stand-in) and 1,000
  Allocates;
- dra-driver: ``sandbox-dra-driver`` against the API server stand-in with the kubelet's DRA
  side: the slice published, 50 claims prepared and unprepared;
- webhook: ``katamgr webhook`` over TLS, 2,000 AdmissionReviews;
- wait (the uninstall's Job): its Python with the Kubernetes client reading the API;
- done: ``python -c "import signal; signal.pause()"``.

Prints one line per container: its peak and the limit the chart gives it. Asserts nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "plugin"))

import yaml  # noqa: E402
from support.registry_server import free_port  # noqa: E402

PYTHON = sys.executable
KATAMGR = str(Path(sys.executable).parent / "katamgr")
ENV = dict(os.environ, PYTHONPATH=str(REPO))
ENV.pop("KUBERNETES_SERVICE_HOST", None)
VALUES = REPO / "deploy/helm/kata-sandbox-manager/values.yaml"
KATA_CLASS = "kata-qemu-nvidia-gpu"


class Peak:
    """The peak RSS of a process, sampled from /proc until it is gone."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.kib = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self.process.poll() is None:
            try:
                for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        self.kib = max(self.kib, int(line.split()[1]))
            except (FileNotFoundError, ProcessLookupError, ValueError):
                break
            time.sleep(0.01)

    def mib(self) -> float:
        self._thread.join(30)
        return self.kib / 1024


def run(args: list[str], env: dict | None = None, timeout: float = 600) -> float:
    process = subprocess.Popen(args, cwd=REPO, env=env or ENV, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    peak = Peak(process)
    _, err = process.communicate(timeout=timeout)
    if process.returncode != 0:
        raise SystemExit(f"{args[:3]} failed ({process.returncode}): {err.decode()[-2000:]}")
    return peak.mib()


def serve(args: list[str], work: Callable[[], None], env: dict | None = None) -> float:
    """Start a server, do ``work`` against it, stop it; its peak."""
    process = subprocess.Popen(args, cwd=REPO, env=env or ENV, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    peak = Peak(process)
    try:
        work()
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return peak.mib()


# -- the agent ---------------------------------------------------------------------------


def big_layout(into: Path, mib: int) -> None:
    """The shipped OCI layout, its initrd replaced by ``mib`` MiB of random bytes."""
    shutil.copytree(REPO / "katamgr/data/oci-layout", into)
    blobs = into / "blobs/sha256"
    index = json.loads((into / "index.json").read_text())
    for entry in index["manifests"]:
        manifest = json.loads((blobs / entry["digest"].split(":")[1]).read_bytes())
        for layer in manifest["layers"]:
            if layer["annotations"]["org.opencontainers.image.title"].endswith(".initrd"):
                digest = hashlib.sha256()
                tmp = blobs / ".big"
                with tmp.open("wb") as out:
                    for _ in range(mib):
                        chunk = os.urandom(1 << 20)
                        digest.update(chunk)
                        out.write(chunk)
                tmp.rename(blobs / digest.hexdigest())
                layer["digest"], layer["size"] = f"sha256:{digest.hexdigest()}", mib << 20
        raw = json.dumps(manifest).encode()
        name = hashlib.sha256(raw).hexdigest()
        (blobs / name).write_bytes(raw)
        entry["digest"], entry["size"] = f"sha256:{name}", len(raw)
    (into / "index.json").write_text(json.dumps(index))


def agent(tmp: Path) -> dict[str, float]:
    from support.apiserver import FakeApiServer

    from nodesim.materialise import materialise
    from nodesim.profiles import find_profile

    host = materialise(find_profile("dgx-h100"), tmp / "host")
    big_layout(host.path("/opt/kata-artifacts/layout"), 256)
    host.path("/etc/containerd").mkdir(parents=True, exist_ok=True)
    host.path("/etc/containerd/config.toml").write_bytes(
        (REPO / "katamgr/data/demo/containerd-config.toml").read_bytes())
    config = tmp / "kata-manager.yaml"
    config.write_text(yaml.safe_dump({
        "artifactsDir": "/opt/nvidia-gpu-operator/artifacts/runtimeclasses",
        "runtimeClasses": [{"name": "kata-qemu-nvidia-gpu", "artifacts": {
            "url": "oci-layout:///opt/kata-artifacts/layout:kata-qemu-nvidia-gpu"}}],
        "containerd": {"restartMode": "none"}}))
    common = ["--host-root", str(host.root), "--config", str(config)]
    offline = dict(ENV, KUBECONFIG="/nonexistent")
    figures = {"kata-manager (apply, 256 MiB artifact)": run([KATAMGR, "apply", *common], offline)}
    with FakeApiServer() as server:
        server.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "dgx-1"}})
        kubeconfig = server.write_kubeconfig(tmp / "kubeconfig")
        online = dict(ENV, KUBECONFIG=str(kubeconfig), NODE_NAME="dgx-1")
        figures["kata-manager (run --once, with the API)"] = run(
            [KATAMGR, "run", "--once", *common], online)
        figures["wait (uninstall Job: the Kubernetes client)"] = run([PYTHON, "-c", (
            "from kubernetes import client, config; config.load_kube_config(); "
            "client.CoreV1Api().read_node('dgx-1')")], online)
    figures["revert (uninstall)"] = run([KATAMGR, "revert", *common], offline)
    return figures


# -- the device plugins ------------------------------------------------------------------


def passthrough_plugin(tmp: Path) -> float:
    import grpc
    import plugincallers as calls

    from gpunode.host.pciids import PciIds
    from gpunode.policy.naming import Naming, resource_name
    from katamgr.pipeline.devices import apply_host
    from katamgr.pipeline.plan import build_plan
    from kubeletapi.deviceplugin_paths import DEVICE_PLUGIN_DIR
    from nodesim.kubelet import KubeletSimulator
    from nodesim.materialise import materialise
    from nodesim.profiles import find_profile
    from sandbox_plugin.resources import socket_name_for

    naming = Naming(PciIds.find())
    h100 = resource_name(naming.pci_ids, 0x10DE, 0x2330)
    host = materialise(find_profile("dgx-h100"), tempfile.mkdtemp(prefix="kbm-"))
    assert apply_host(host, build_plan(host, naming)).ok
    kubelet = KubeletSimulator(host)
    kubelet.start()
    socket = host.path(DEVICE_PLUGIN_DIR) / socket_name_for(h100)

    def work() -> None:
        state = kubelet.wait_for(lambda s: len(s.devices.get(h100, [])) == 8, timeout=60)
        gpus = [d.id for d in state.devices[h100]]
        request = calls.allocate_request([gpus[0]])
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            call = channel.unary_unary(calls.ALLOCATE)
            for _ in range(2000):
                call(request, timeout=10)
        import multiprocessing

        # One GPU a call: the plugin runs with the fabric as the chart's does (dgx-h100's Fabric
        # Manager, Shared NVSwitch model), where two GPUs must be one partition.
        calls.paced(multiprocessing.get_context("spawn"), socket, gpus, calls.Load(100, 10.0, 4.0, pairs=False), 4)
        subprocess.run([PYTHON, str(REPO / "tests/plugin/hostile.py"), "large_bodies", str(socket), "4"],
                       cwd=REPO, env=ENV, capture_output=True, timeout=120, check=True)

    try:
        return serve([PYTHON, "-m", "sandbox_plugin.cli", "--workload", "vm-passthrough", "--host-root",
                      str(host.root), "--metrics-address", f"127.0.0.1:{free_port()}"], work)
    finally:
        kubelet.stop()
        shutil.rmtree(host.root, ignore_errors=True)


def container_plugin(tmp: Path) -> float:
    from nodesim.kubelet import KubeletSimulator
    from nodesim.materialise import materialise
    from nodesim.profiles import find_profile

    host = materialise(find_profile("a10-server"), tempfile.mkdtemp(prefix="kbm-"))
    kubelet = KubeletSimulator(host)
    kubelet.start()

    def work() -> None:
        state = kubelet.wait_for(lambda s: len(s.devices.get("nvidia.com/gpu", [])) == 4, timeout=60)
        gpu = state.devices["nvidia.com/gpu"][0].id
        for _ in range(1000):
            kubelet.allocate("nvidia.com/gpu", [gpu])

    try:
        return serve([PYTHON, "-m", "sandbox_plugin.cli", "--workload", "container", "--host-root",
                      str(host.root), "--metrics-address", f"127.0.0.1:{free_port()}"], work)
    finally:
        kubelet.stop()
        shutil.rmtree(host.root, ignore_errors=True)


def dra_driver(tmp: Path) -> float:
    from drakit import DRIVER, NODE, make_node

    node, cleanup = make_node(start=False)
    try:
        node.server.update("nodes", NODE, lambda n: n["metadata"].setdefault("labels", {}).update(
            {"nvidia.com/gpu.workload.config": "vm-passthrough"}))
        env = dict(ENV, KUBECONFIG=str(node.server.write_kubeconfig(tmp / "dra-kubeconfig")))

        def work() -> None:
            deadline = time.monotonic() + 60
            while not node.slices():
                if time.monotonic() > deadline:
                    raise SystemExit("the DRA driver published no slice")
                time.sleep(0.05)
            node.dra.wait_for(lambda s: s.current(DRIVER) is not None, timeout=30)
            devices = [d["name"] for d in node.slice()["spec"]["devices"] if d["name"].startswith("gpu-")]
            for n in range(50):
                pod = node.pod(f"p{n}", KATA_CLASS)
                uid = pod["metadata"]["uid"]
                claim = node.claim(f"c{n}", [devices[n % len(devices)]], pod_uid=uid, pod_name=f"p{n}")
                node.dra.prepare_pod("default", f"p{n}", uid, {"c": [claim["metadata"]["name"]]})
                node.dra.unprepare(DRIVER, [node.ref(claim)])

        return serve([PYTHON, "-m", "sandbox_plugin.dra.cli", "--host-root", str(node.host.root),
                      "--node-name", NODE], work, env)
    finally:
        cleanup()


def webhook(tmp: Path) -> float:
    from support import podkit
    from support.tlskit import Client, make_ca, write_server_pair

    ca = make_ca()
    cert, key = tmp / "tls.crt", tmp / "tls.key"
    write_server_pair(ca, cert, key)
    port = free_port()
    bodies = [json.dumps(podkit.review(pod)).encode() for pod in podkit.cases().values()]

    def work() -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                client = Client(port, ca)
                client.request("GET", "/healthz")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        for n in range(2000):
            client.request("POST", "/mutate" if n % 2 else "/validate", bodies[n % len(bodies)])
        client.close()

    return serve([KATAMGR, "webhook", "--listen", f"127.0.0.1:{port}", "--tls-cert-file", str(cert),
                  "--tls-private-key-file", str(key)], work)


def done() -> float:
    def work() -> None:
        time.sleep(1.0)

    return serve([PYTHON, "-c", "import signal; signal.pause()"], work)


def limits() -> dict[str, str]:
    """The memory limit each container gets from the chart's defaults."""
    values = yaml.safe_load(VALUES.read_text())
    defaults = values["defaultResources"]

    def limit(block: dict | None) -> str:
        return ((block or {}).get("limits") or {}).get("memory", "none")

    return {
        "kata-manager": limit(defaults["kataManager"]),
        "revert": limit(defaults["kataManager"]),
        "sandbox-device-plugin": limit(defaults["sandboxDevicePlugin"]),
        "dra-driver": limit(defaults["sandboxDevicePlugin"]),
        "device-plugin": limit(defaults["devicePlugin"]),
        "webhook": limit(values["isolation"]["webhook"]["resources"]),
        "wait": limit(defaults["uninstall"]),
        "done": limit(defaults["uninstall"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", choices=["agent", "plugin", "container", "dra",
                                                            "webhook", "done"],
                        help="measure only these (default: all)")
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    chart = limits()
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as directory:
        tmp = Path(directory)
        parts = {
            "agent": lambda: figures.update(agent(tmp)),
            "plugin": lambda: figures.update({
                "sandbox-device-plugin (vm-passthrough, loads and hostile bodies)": passthrough_plugin(tmp)}),
            "container": lambda: figures.update({"device-plugin (container, NVML)": container_plugin(tmp)}),
            "dra": lambda: figures.update({"dra-driver (50 claims prepared)": dra_driver(tmp)}),
            "webhook": lambda: figures.update({"webhook (2,000 reviews over TLS)": webhook(tmp)}),
            "done": lambda: figures.update({"done (uninstall DaemonSet)": done()}),
        }
        for name, measure in parts.items():
            if not args.only or name in args.only:
                measure()
    print(f"\n  {'container (workload)':<66}{'peak RSS':>10}  chart limit")
    for name, mib in figures.items():
        print(f"  {name:<66}{mib:8.1f} MiB  {chart[name.split(' ')[0]]}")


if __name__ == "__main__":
    main()
