"""A stand-in for the Kata shim's cold-plug of a pod's devices.

Kata's own code is the test of record: ``hack/kata/build`` builds a cold-plug oracle on the
runtime code of Kata 3.25.0, 3.29.0 and 4.1.0, and ``tests/kata`` runs it on every simulated host
profile, the real node and the real kernel (``tests/support/kataoracle.py``). This stand-in
stays for the fast tests, ``katamgr demo`` and Kata's pending DRA cold-plug (which no release
has yet), and ``tests/kata/test_stand_in_follows_kata.py`` checks it against that code on
the same inputs. It does what those releases do at sandbox creation when ``cold_plug_vfio``
is set and ``pod_resource_api_sock`` names a socket (file names under ``src/runtime/``):

1. take the pod's name and namespace from the sandbox annotations
   ``io.kubernetes.cri.sandbox-name`` / ``io.kubernetes.cri.sandbox-namespace``
   (3.29 falls back to CRI-O's ``io.kubernetes.cri-o.KubeName`` / ``io.kubernetes.cri-o.Namespace``,
   and names the pod in its error; ``release`` picks which);
2. call the kubelet's PodResources v1 ``Get`` for it;
3. for every container, every device-plugin device becomes the CDI name
   ``<resource_name>=<device_id>``, repeats kept
   (``pkg/containerd-shim-v2/device_cold_plug.go``: ``getDeviceSpec``, ``formatCDIDevIDs``);
4. resolve them all in the host's CDI registry (``/etc/cdi``, ``/var/run/cdi``) and inject
   their edits into the sandbox's spec: a spec's own edits once, before its first device's,
   then each device's; a device node already in the spec is removed and added again at the
   end. Any name that does not resolve fails the sandbox, the error listing every name asked
   for (container-device-interface v0.6.0, ``pkg/cdi/cache.go`` ``InjectDevices`` and
   ``container-edits.go`` ``Apply``);
5. every injected node under ``/dev/vfio/`` but ``/dev/vfio/vfio`` is a VFIO device
   (``pkg/device/manager/utils.go`` ``IsVFIODevice``), one per node
   (``manager.go`` ``FindDevice``: one major:minor, one device). Its functions
   (``pkg/device/drivers/utils.go``): ``/dev/vfio/<group>`` gives every device in
   ``/sys/kernel/iommu_groups/<group>/devices``, in name order, less the "bridges"
   (``checkIgnorePCIClass``): in 3.x those whose class ``& 0x0600 == 0x0600`` (host and PCI
   bridges, and an NVSwitch, class 0x0680, too); from 4.1 only a host bridge (0x0600) or a
   PCI-to-PCI bridge (0x0604), matched exactly (``pciClassesIgnoredForPassthrough``), so an
   NVSwitch is plugged; an iommufd cdev ``/dev/vfio/devices/vfioN`` gives the one
   device it belongs to (Kata follows ``/sys/dev/char/<major:minor>``);
6. QEMU gets one ``-device vfio-pci,host=<bdf>,x-pci-vendor-id=...,x-pci-device-id=...``
   (4.1 adds ``id=vfio-<ID><n>`` after ``host=``: govmm's ``VFIODevice.QemuParams``) per VFIO device: for its *first* function only (``virtcontainers/sandbox.go``
   ``AppendDevice`` returns after the first), and a device with no function left fails the
   sandbox with "unsupported device type" (an NVSwitch alone in its group, before Kata 4.1).
   A PCI Express function (config space over 256 bytes, ``IsPCIeDevice``) is put on a root
   port, ``bus=rp<n>``, numbered over every PCIe function of every device, plugged or not;
   a conventional PCI one gets no bus. The VM has as many root ports as those functions, or
   ``pcie_root_port`` if more (``qemu.go`` ``createPCIeTopology``).

Devices from DRA claims: no Kata release cold-plugs them. Both shims read only
``ContainerResources.devices`` of the PodResources answer (Kata issue #13322). The pending
pull requests #13323 (Go shim) and #13420 (runtime-rs) add the Kata config setting
``[runtime] pod_resource_device_sources`` (``"device-plugin"``, ``"dra"``; default
``["device-plugin"]``; empty, unknown or repeated values refused): the listed sources' CDI
names are merged, repeats dropped; a source not listed whose names resolve in CDI fails the
sandbox naming the setting, and one device reached through both sources fails it too. The
stand-in does what the released Kata does (``sources=None``) unless given the sources, when
it does what those pull requests describe, so a test can show both.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import grpc

import cdi
from gpunode.host.root import HostRoot
from kubeletapi import podresources_pb2 as pr
from kubeletapi import podresources_pb2_grpc as pr_grpc
from nodesim.dial import dial

NAME_ANNOTATIONS = ("io.kubernetes.cri.sandbox-name", "io.kubernetes.cri-o.KubeName")
NAMESPACE_ANNOTATIONS = ("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.cri-o.Namespace")
# Kata 3.x's bridge test: the class masked with 0x0600 (so 0x0680, an NVSwitch, is one too).
BRIDGE_MASK = 0x0600
# Kata 4.1's: these classes exactly (host bridge, PCI-to-PCI bridge).
BRIDGES_FROM_4_1 = (0x0600, 0x0604)
EXACT_BRIDGES_FROM = (4, 1)
PCI_CONFIG_SIZE = 256
DEVICE_PLUGIN = "device-plugin"  # ContainerResources.devices
DRA = "dra"  # ContainerResources.dynamic_resources (pending upstream)
SOURCES = (DEVICE_PLUGIN, DRA)
SOURCES_SETTING = "pod_resource_device_sources"
RELEASED = None  # the released Kata: no sources setting, device-plugin devices only
LATEST = "3.29.0"
CRIO_FROM = (3, 29)  # CRI-O's annotations read, and the pod named in the error
_VFIO_DIR = "/dev/vfio/"
_VFIO_CONTAINER = "/dev/vfio/vfio"


class ColdPlugError(Exception):
    """The sandbox would fail to start."""


@dataclass(frozen=True)
class Plugged:
    """One PCI function on QEMU's command line."""

    bdf: str
    vendor: str  # "0x10de", as sysfs has it
    device: str
    bus: str | None  # "rp0", or None for a conventional PCI function
    qemu_id: str | None = None  # Kata 4.1's id= (the VFIO device's ID), None before

    @property
    def arg(self) -> str:
        named = f",id={self.qemu_id}" if self.qemu_id else ""
        arg = f"vfio-pci,host={self.bdf}{named},x-pci-vendor-id={self.vendor},x-pci-device-id={self.device}"
        return arg + (f",bus={self.bus}" if self.bus else "")


@dataclass(frozen=True)
class ColdPlug:
    """What the shim would do for one pod."""

    cdi_names: tuple[str, ...]  # as formed from PodResources
    device_nodes: tuple[str, ...]  # the nodes the resolved CDI edits inject, in the spec's order
    plugged: tuple[Plugged, ...]  # the PCI functions handed to QEMU, in order
    root_ports: int

    @property
    def functions(self) -> tuple[str, ...]:
        return tuple(p.bdf for p in self.plugged)

    @property
    def qemu_args(self) -> list[str]:
        return [arg for p in self.plugged for arg in ("-device", p.arg)]


def _version(release: str) -> tuple[int, ...]:
    return tuple(int(p) for p in release.split("."))


def pod_identity(annotations: Mapping[str, str], release: str = LATEST) -> tuple[str, str]:
    keys = 2 if _version(release) >= CRIO_FROM else 1
    name = next((annotations[k] for k in NAME_ANNOTATIONS[:keys] if annotations.get(k)), "")
    namespace = next((annotations[k] for k in NAMESPACE_ANNOTATIONS[:keys] if annotations.get(k)), "")
    return name, namespace


def _go_status(exc: grpc.RpcError) -> str:
    """A gRPC error as grpc-go's status prints it."""
    code = "".join(w.capitalize() for w in exc.code().name.split("_"))
    return f"rpc error: code = {code} desc = {exc.details()}"


def _pod_resources(socket: os.PathLike[str] | str, annotations: Mapping[str, str], release: str = LATEST):
    name, namespace = pod_identity(annotations, release)
    with dial(socket) as channel:
        stub = pr_grpc.PodResourcesListerStub(channel)
        try:
            answer = stub.Get(pr.GetPodResourcesRequest(pod_name=name, pod_namespace=namespace), timeout=5)
        except grpc.RpcError as exc:
            which = f" for pod({name}) in namespace({namespace})" if _version(release) >= CRIO_FROM else ""
            raise ColdPlugError(f"device cold plug failed: cold plug: GetPodResources failed{which}: "
                                f"{_go_status(exc)}") from exc
    if not answer.HasField("pod_resources"):
        raise ColdPlugError("device cold plug failed: cold plug: PodResources is nil")
    return answer.pod_resources


def _names_by_source(pod) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {DEVICE_PLUGIN: [], DRA: []}
    for container in pod.containers:
        for devices in container.devices:
            out[DEVICE_PLUGIN] += [f"{devices.resource_name}={i}" for i in devices.device_ids]
        out[DRA] += [d.name for claim in container.dynamic_resources
                     for resource in claim.claim_resources for d in resource.cdi_devices]
    return out


def check_sources(sources: Iterable[str]) -> tuple[str, ...]:
    """The pending setting's values, refused as those pull requests refuse them at config load."""
    sources = tuple(sources)
    if not sources:
        raise ValueError(f"{SOURCES_SETTING} is empty; list \"device-plugin\", \"dra\" or both")
    for source in sources:
        if source not in SOURCES:
            raise ValueError(f"{SOURCES_SETTING}: unknown source {source!r} (known: {', '.join(SOURCES)})")
    if len(set(sources)) != len(sources):
        raise ValueError(f"{SOURCES_SETTING} repeats a source: {list(sources)}")
    return sources


def pod_cdi_names(socket: os.PathLike[str] | str, annotations: Mapping[str, str],
                  sources: tuple[str, ...] | None = RELEASED, release: str = LATEST) -> list[str]:
    """Steps 1-3: the CDI names the shim forms for the pod from the kubelet's answer (from the
    listed sources, repeats dropped, when ``sources`` is given: see the module doc)."""
    by_source = _names_by_source(_pod_resources(socket, annotations, release))
    if sources is RELEASED:
        return by_source[DEVICE_PLUGIN]
    return list(dict.fromkeys(n for s in check_sources(sources) for n in by_source[s]))


def _registry(host: HostRoot, spec_dirs: Iterable[str]) -> cdi.SpecRegistry:
    return cdi.load_specs([host.path(d) for d in spec_dirs])


def resolve(host: HostRoot, names: Iterable[str],
            spec_dirs: Iterable[str] = cdi.DEFAULT_SPEC_DIRS) -> list[str]:
    """Step 4: the device nodes the names inject, in the spec's order; ColdPlugError when
    one does not resolve."""
    names = list(names)
    registry = _registry(host, spec_dirs)
    edits: list[cdi.ContainerEdits] = []
    seen_specs: set[int] = set()
    unresolved = []
    for name in names:
        try:
            found = registry.resolve(name)
        except (cdi.UnresolvedDeviceError, cdi.InvalidNameError):
            unresolved.append(name)
            continue
        if id(found.source) not in seen_specs:
            seen_specs.add(id(found.source))
            edits.append(found.spec.container_edits)
        edits.append(found.device.container_edits)
    if unresolved:
        raise ColdPlugError("device cold plug failed: cold plug: CDI device injection failed: CDI device "
                            f"injection failed: unresolvable CDI devices {', '.join(names)}")
    nodes: list[str] = []
    for edit in edits:
        for node in edit.device_nodes:
            if node.path in nodes:
                nodes.remove(node.path)
            nodes.append(node.path)
    return nodes


def _host_nodes(host: HostRoot, names: Iterable[str], spec_dirs: Iterable[str]) -> dict[str, str]:
    """Container path -> host path (as the node names it) of the nodes the names inject."""
    registry = _registry(host, spec_dirs)
    out: dict[str, str] = {}
    for name in names:
        found = registry.resolve(name)
        for edit in (found.spec.container_edits, found.device.container_edits):
            for node in edit.device_nodes:
                out[node.path] = host.host_node(node.host_path or node.path)
    return out


def _read(path) -> str:
    return path.read_text().split("\n", 1)[0]


def _is_bridge(pci_class: int, release: str) -> bool:
    if _version(release) >= EXACT_BRIDGES_FROM:
        return pci_class in BRIDGES_FROM_4_1
    return pci_class & BRIDGE_MASK == BRIDGE_MASK


def functions_of(host: HostRoot, node: str, release: str = LATEST) -> list[str]:
    """Step 5: the PCI functions Kata finds for one VFIO device node (the first is plugged)."""
    if not node.startswith(_VFIO_DIR) or node.startswith(_VFIO_CONTAINER):
        return []
    if node.startswith("/dev/vfio/devices/"):
        cdev = node.rsplit("/", 1)[1]
        devices = host.path("/sys/bus/pci/devices")
        owners = sorted(b for b in os.listdir(devices) if (devices / b / "vfio-dev" / cdev).exists())
        if len(owners) != 1:
            raise ColdPlugError(f"{node}: no single PCI device owns vfio cdev {cdev} ({owners})")
        return owners
    group = node.rsplit("/", 1)[1]
    members = host.path(f"/sys/kernel/iommu_groups/{group}/devices")
    try:
        bdfs = sorted(os.listdir(members))
    except FileNotFoundError:
        raise ColdPlugError(f"open {members}: no such file or directory") from None
    return [b for b in bdfs if not _is_bridge(int(_read(members / b / "class"), 16) >> 8, release)]


def _is_pcie(host: HostRoot, bdf: str) -> bool:
    try:
        return os.stat(host.path(f"/sys/bus/pci/devices/{bdf}/config")).st_size > PCI_CONFIG_SIZE
    except FileNotFoundError:
        return False  # Kata: "Who knows?"


def _check_sources(host: HostRoot, by_source: dict[str, list[str]], sources: tuple[str, ...],
                   spec_dirs: Iterable[str], release: str) -> None:
    """The pending pull requests' refusals (module doc)."""
    registry = _registry(host, spec_dirs)

    def resolvable(names):
        out = []
        for name in names:
            try:
                out.append(registry.resolve(name))
            except (cdi.UnresolvedDeviceError, cdi.InvalidNameError):
                pass
        return out

    for source in SOURCES:
        if source not in sources and resolvable(by_source[source]):
            raise ColdPlugError(f"cold plug: the pod has {source} devices, but {SOURCES_SETTING} "
                                f"lists only {', '.join(sources)}")
    if set(SOURCES) <= set(sources):
        reached = []
        for source in SOURCES:
            nodes = {n for d in resolvable(by_source[source])
                     for e in (d.device.container_edits,) for n in (x.path for x in e.device_nodes)}
            reached.append({f for n in nodes for f in functions_of(host, n, release)})
        if both := sorted(reached[0] & reached[1]):
            raise ColdPlugError(f"cold plug: {', '.join(both)} is reached through both device-plugin and dra")


def cold_plug(host: HostRoot, socket: os.PathLike[str] | str, annotations: Mapping[str, str],
              sources: tuple[str, ...] | None = RELEASED, pcie_root_port: int = 0,
              spec_dirs: Iterable[str] = cdi.DEFAULT_SPEC_DIRS, release: str = LATEST) -> ColdPlug:
    """Everything the shim of Kata ``release`` does for one pod sandbox, or ColdPlugError
    where it would fail."""
    spec_dirs = tuple(spec_dirs)
    if sources is RELEASED:
        names = pod_cdi_names(socket, annotations, release=release)
    else:
        sources = check_sources(sources)
        by_source = _names_by_source(_pod_resources(socket, annotations, release))
        _check_sources(host, by_source, sources, spec_dirs, release)
        names = list(dict.fromkeys(n for s in sources for n in by_source[s]))
    nodes = resolve(host, names, spec_dirs) if names else []
    host_paths = _host_nodes(host, names, spec_dirs)
    devices = [(node, functions_of(host, host_paths.get(node, node), release))
               for node in nodes if node.startswith(_VFIO_DIR) and not node.startswith(_VFIO_CONTAINER)]
    pcie = [bdf for _node, functions in devices for bdf in functions if _is_pcie(host, bdf)]
    root_ports = max(len(pcie), pcie_root_port)
    plugged: list[Plugged] = []
    exact = _version(release) >= EXACT_BRIDGES_FROM
    port = 0
    for _node, functions in devices:
        if not functions:
            raise ColdPlugError("unsupported device type")
        buses = []
        for bdf in functions:
            if _is_pcie(host, bdf):
                buses.append(f"rp{port}")
                port += 1
            else:
                buses.append(None)
        first = functions[0]
        attrs = host.path(f"/sys/bus/pci/devices/{first}")
        # Kata 4.1 names the device on QEMU's command line so QMP finds it: "vfio-", the device
        # manager's random ID (here one drawn from the node's path) and the function's index.
        named = f"vfio-{hashlib.sha256(_node.encode()).hexdigest()[:16]}0" if exact else None
        plugged.append(Plugged(first, _read(attrs / "vendor"), _read(attrs / "device"), buses[0], named))
    return ColdPlug(tuple(names), tuple(nodes), tuple(plugged), root_ports)


def sandbox_annotations(namespace: str, name: str) -> dict[str, str]:
    """What containerd's CRI puts on a pod sandbox."""
    return {NAME_ANNOTATIONS[0]: name, NAMESPACE_ANNOTATIONS[0]: namespace}
