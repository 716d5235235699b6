"""A workload switch on the real node of tests/node, as its fault tests watch it: whether the
node has settled where the label asks, whether a switch is under way, the agent's log, metrics
and Events, and Kata pods whose stood-in VMs hold GPUs.

Settled means nothing is stranded: every GPU and NVSwitch is on the driver the label asks for
(``vfio-pci`` for vm-passthrough, ``nvidia`` for container) except those a running Kata VM
holds, which stay on ``vfio-pci``; and the Node's allocatable says the same (the model-named
resource on a vm-passthrough node; ``nvidia.com/gpu`` on a container node, less the held GPUs,
which the model-named resource still lists for their pods).

A running Kata VM holds its IOMMU groups' ``/dev/vfio`` nodes open; no Kata guest runs here
(the Kata class's handler is runc), so each VM pod's QEMU is stood in for in the simulated
host's ``/proc`` (``VmPod``), where the agent looks for holders, with the groups Kata's shim
would cold-plug for the pod (``nodekit.vm_devices``: the stand-in, checked against Kata's own
code). The tests slow the simulated kernel (``SLOW_MS``: each bind and unbind holds its writer
250 ms, as a real GPU's driver teardown and probe take time), so a switch of the node's 12
devices takes seconds and a fault can land inside it.
"""

from __future__ import annotations

from datetime import UTC, datetime

from support.kubecluster import wait_for
from support.nodekit import (
    AGENT,
    CONTAINER_GPU,
    GPU_RESOURCE,
    IMAGE,
    KATA_CLASS,
    NVSWITCH_RESOURCE,
    WORKLOAD,
    restart_count,
    vm_devices,
)

NAMESPACE = "node-fault-tests"
CONTAINER_PLUGIN = "app.kubernetes.io/component=device-plugin"
SLOW_MS = 250
GPUS, NVSWITCHES = 8, 4
PASSTHROUGH, CONTAINER = "vm-passthrough", "container"
# The simulated QEMUs' PIDs in the simulated host's /proc (no real process has them).
VM_PIDS = iter(range(900_000, 901_000))


# --- the node's state -------------------------------------------------------------------


def settled(node, workload: str, vms: list[VmPod | Given], timeout: float = 90) -> dict[str, str | None]:
    """Wait until every device is where ``workload`` wants it (held ones stay on vfio-pci)
    and the Node's allocatable says so; the drivers."""
    held = {bdf for vm in vms for bdf in vm.functions}
    want = "vfio-pci" if workload == PASSTHROUGH else "nvidia"

    def placed():
        drivers = node.drivers()
        wrong = {bdf: d for bdf, d in drivers.items() if d != ("vfio-pci" if bdf in held else want)}
        return drivers if not wrong else None
    try:
        drivers = wait_for(placed, f"every device on {want} (held: {sorted(held)})", timeout, every=0.2)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{node.drivers()}\nagent log:\n{agent_log(node)[-3000:]}") from None
    gpus_held = sum(1 for vm in vms for _ in vm.gpus)

    def listed():
        status = node.get()["status"]
        a, c = status.get("allocatable", {}), status.get("capacity", {})
        if workload == PASSTHROUGH:
            ok = (a.get(GPU_RESOURCE) == c.get(GPU_RESOURCE) == str(GPUS)
                  and a.get(NVSWITCH_RESOURCE) == str(NVSWITCHES) and a.get(CONTAINER_GPU, "0") == "0")
        else:
            # The GPUs pods still hold stay listed by the passthrough plugin (never
            # allocated again), so that a restarted kubelet keeps those pods.
            ok = (a.get(CONTAINER_GPU) == str(GPUS - gpus_held) and a.get(GPU_RESOURCE, "0") == str(gpus_held)
                  and a.get(NVSWITCH_RESOURCE, "0") == "0")
        return a if ok else None
    try:
        wait_for(listed, f"allocatable of a {workload} node ({gpus_held} GPUs held)", timeout, every=0.5)
    except AssertionError as e:
        status = node.get()["status"]
        raise AssertionError(f"{e}\nallocatable {status.get('allocatable')}\ncapacity {status.get('capacity')}\n"
                             f"{node.cluster.kubectl('get', 'pods', '-A', check=False).stdout}"
                             f"\nagent log:\n{agent_log(node)[-2000:]}") from None
    return drivers


def moving(node, towards: str, timeout: float = 30) -> dict[str, str | None]:
    """Wait until the switch is under way: some device on ``towards``' driver, not all."""
    want = "vfio-pci" if towards == PASSTHROUGH else "nvidia"

    def under_way():
        drivers = node.drivers()
        there = sum(d == want for d in drivers.values())
        return drivers if 0 < there < len(drivers) - 2 else None
    return wait_for(under_way, f"a switch to {towards} under way", timeout, every=0.02)


def agent_log(node) -> str:
    pods = [p for p in node.pods(AGENT) if not p["metadata"].get("deletionTimestamp")]
    return node.logs(pods[0]["metadata"]["name"], pods[0]["metadata"]["namespace"], "kata-manager") if pods else ""


def agent_metrics(node) -> str:
    return node.scrape(node.wait_ready(AGENT)[0], 9410)


def events_since(node, reason: str, since: datetime) -> list[dict]:
    def when(e):
        stamp = e.get("lastTimestamp") or e.get("eventTime") or e["metadata"]["creationTimestamp"]
        return datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    return sorted((e for e in node.events(reason) if when(e) >= since.replace(microsecond=0)), key=when)


def told(node, reason: str, since: datetime, timeout: float = 30) -> list[dict]:
    """The ``reason`` Events since ``since``, waiting for the first: the agent records one
    after what it tells of is done (GPUs moved, CDI specs and readiness files written), so a
    test that saw the GPUs move may look a moment before it is there."""
    return wait_for(lambda: events_since(node, reason, since), f"a {reason} Event", timeout, every=0.5)


def now() -> datetime:
    return datetime.now(UTC)


def relabel(node, workload: str) -> None:
    node.label(WORKLOAD, workload)


# --- Kata pods and their VMs --------------------------------------------------------------


def kata_pod(name: str, gpus: int) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"runtimeClassName": KATA_CLASS, "restartPolicy": "Never",
                     "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": IMAGE, "imagePullPolicy": "Never",
                                     "command": ["sleep", "3600"],
                                     "resources": {"limits": {GPU_RESOURCE: gpus}}}]}}


class VmPod:
    """A Kata pod with ``gpus`` GPUs whose VM holds them (its QEMU in the host's /proc).
    Each one not yet ended is in ``VmPod.live``."""

    live: list[VmPod] = []

    def __init__(self, node, name: str, gpus: int) -> None:
        self.node, self.name = node, name
        node.run(kata_pod(name, gpus))
        self.pod = node.wait_phase(name, NAMESPACE)
        root = node.cluster.host_root
        plug = vm_devices(node, NAMESPACE, name)
        self.functions = list(plug.functions)
        self.gpus = [bdf for bdf in plug.functions if bdf in node.drivers()]
        self.groups = [n.rsplit("/", 1)[1] for n in plug.device_nodes if n != "/dev/vfio/vfio"]
        assert len(self.groups) == gpus, plug
        self.pid = next(VM_PIDS)
        fd_dir = root / f"proc/{self.pid}/fd"
        fd_dir.mkdir(parents=True)
        (fd_dir.parent / "comm").write_text("qemu-system-x86\n")
        for i, group in enumerate(self.groups):
            (fd_dir / str(20 + i)).symlink_to(f"/dev/vfio/{group}")
        VmPod.live.append(self)

    @property
    def container_id(self) -> str:
        return self.pod["status"]["containerStatuses"][0]["containerID"]

    def undisturbed(self) -> None:
        pod = self.node.pod(self.name, NAMESPACE)
        assert pod["status"]["phase"] == "Running", pod["status"]
        assert pod["status"]["containerStatuses"][0]["containerID"] == self.container_id
        assert restart_count(pod) == 0

    def vm_exits(self) -> None:
        """QEMU exits and lets go of the groups."""
        proc = self.node.cluster.host_root / f"proc/{self.pid}"
        if not proc.exists():
            return
        for link in (proc / "fd").iterdir():
            link.unlink()
        (proc / "fd").rmdir()
        (proc / "comm").unlink()
        proc.rmdir()

    def end(self) -> None:
        """The VM exits, then its pod is deleted."""
        self.vm_exits()
        self.node.delete_pod(self.name, NAMESPACE)
        if self in VmPod.live:
            VmPod.live.remove(self)


class Given:
    """The GPUs the kubelet gave a pod (no VM holds them), as Kata's shim reads them."""

    def __init__(self, node, name: str) -> None:
        plug = vm_devices(node, NAMESPACE, name)
        self.functions = list(plug.functions)
        self.gpus = list(plug.functions)
