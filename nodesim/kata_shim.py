"""A stand-in for the Kata shim's cold-plug of a pod's devices.

No Kata runs on our build machines, so tests and ``katamgr demo`` check our
side of the contract against this. It does what the Kata 3.x Go shim does at
sandbox creation when ``cold_plug_vfio`` is set and ``pod_resource_api_sock``
names a socket (package ``containerdshim`` in ``src/runtime/pkg/containerd-shim-v2``:
``coldPlugDevices``, ``getDeviceSpec``, ``formatCDIDevIDs``; and
``src/runtime/pkg/device/drivers/utils.go``: ``GetAllVFIODevicesFromIOMMUGroup``,
``GetDeviceFromVFIODev``):

1. take the pod's name and namespace from the sandbox annotations
   ``io.kubernetes.cri.sandbox-name`` / ``io.kubernetes.cri.sandbox-namespace``
   (CRI-O: ``io.kubernetes.cri-o.KubeName`` / ``io.kubernetes.cri-o.Namespace``);
2. call the kubelet's PodResources v1 ``Get`` for it;
3. for every container, every device-plugin device becomes the CDI name
   ``<resource_name>=<device_id>``; repeats are dropped, order kept;
4. resolve those names in the host's CDI registry (``/etc/cdi``, ``/var/run/cdi``);
   any name that does not resolve fails the sandbox ("unresolvable CDI devices");
5. for each injected VFIO device node, find the PCI functions to cold-plug:
   ``/dev/vfio/<group>`` means every device in
   ``/sys/kernel/iommu_groups/<group>/devices`` except host bridges (class 0x0600)
   and PCI-to-PCI bridges (0x0604); an iommufd cdev ``/dev/vfio/devices/vfioN``
   means the one device it belongs to (Kata follows ``/sys/dev/char/<major:minor>``;
   simulated nodes are plain files, so the stand-in finds the device whose
   ``vfio-dev/vfioN`` exists); ``/dev/vfio/vfio`` and ``/dev/iommu`` plug nothing;
6. QEMU gets ``-device vfio-pci,host=<bdf>`` per function (on its own root port).

Devices from DRA claims: upstream Kata does not cold-plug them. Both shims read
only ``ContainerResources.devices`` of the PodResources answer, never its
``dynamic_resources`` (kata-containers commit 7c6ba40c54ea29b459b4997cff948caaba4e658b,
2026-08-22: the Go shim's ``src/runtime/pkg/containerd-shim-v2/device_cold_plug.go``
``getDeviceSpec``, last changed in 92da7974f51d9b1ff8b0aa1720446a5cf399b166; runtime-rs'
``src/libs/pod-resources-rs/src/pod_resources/mod.rs``, last changed in
1441b2b84a00c2283ac4368047c13eb451a5856f). Kata issue #13322 reports it; the open pull
requests #13323 (Go shim: collect the CDI IDs of
``dynamic_resources[].claim_resources[].cdi_devices[]`` too, merged with the
device-plugin names, repeats dropped) and #13420 (runtime-rs, opt-in by
``pod_resource_device_sources = ["device-plugin", "dra"]``) would add it. So the
stand-in reads what upstream reads (``UPSTREAM_SOURCES``) unless told to read the
claims too (``sources=(DEVICE_PLUGIN, DRA)``: what those pull requests propose), and a
test can show both.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import grpc

import cdi
from katamgr.host.root import HostRoot
from kubeletapi import podresources_pb2 as pr
from kubeletapi import podresources_pb2_grpc as pr_grpc

NAME_ANNOTATIONS = ("io.kubernetes.cri.sandbox-name", "io.kubernetes.cri-o.KubeName")
NAMESPACE_ANNOTATIONS = ("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.cri-o.Namespace")
_BRIDGE_CLASSES = (0x0600, 0x0604)
DEVICE_PLUGIN = "device-plugin"  # ContainerResources.devices
DRA = "dra"  # ContainerResources.dynamic_resources (proposed upstream, not merged)
UPSTREAM_SOURCES = (DEVICE_PLUGIN,)
_PLUG_NOTHING = ("/dev/vfio/vfio", "/dev/iommu")


class ColdPlugError(Exception):
    """The sandbox would fail to start."""


@dataclass(frozen=True)
class ColdPlug:
    """What the shim would do for one pod."""

    cdi_names: tuple[str, ...]  # as formed from PodResources
    device_nodes: tuple[str, ...]  # host paths the resolved CDI edits inject
    functions: tuple[str, ...]  # PCI functions handed to QEMU, in order

    @property
    def qemu_args(self) -> list[str]:
        return [arg for bdf in self.functions for arg in ("-device", f"vfio-pci,host={bdf}")]


def pod_identity(annotations: Mapping[str, str]) -> tuple[str, str]:
    name = next((annotations[k] for k in NAME_ANNOTATIONS if annotations.get(k)), "")
    namespace = next((annotations[k] for k in NAMESPACE_ANNOTATIONS if annotations.get(k)), "")
    return name, namespace


def pod_cdi_names(socket: os.PathLike[str] | str, annotations: Mapping[str, str],
                  sources: tuple[str, ...] = UPSTREAM_SOURCES) -> list[str]:
    """Steps 1-3: the CDI names the shim forms for the pod from the kubelet's answer
    (from the claims too when ``sources`` has ``DRA``: see the module doc)."""
    name, namespace = pod_identity(annotations)
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = pr_grpc.PodResourcesListerStub(channel)
        try:
            answer = stub.Get(pr.GetPodResourcesRequest(pod_name=name, pod_namespace=namespace), timeout=5)
        except grpc.RpcError as exc:
            raise ColdPlugError(f"cold plug: GetPodResources failed for pod({name}) in "
                                f"namespace({namespace}): {exc.details()}") from exc
    if not answer.HasField("pod_resources"):
        raise ColdPlugError("cold plug: PodResources is nil")
    names: list[str] = []
    for container in answer.pod_resources.containers:
        if DEVICE_PLUGIN in sources:
            for devices in container.devices:
                names += [f"{devices.resource_name}={i}" for i in devices.device_ids]
        if DRA in sources:
            names += [cdi.name for claim in container.dynamic_resources
                      for resource in claim.claim_resources for cdi in resource.cdi_devices]
    return list(dict.fromkeys(names))


def resolve(host: HostRoot, names: Iterable[str],
            spec_dirs: Iterable[str] = cdi.DEFAULT_SPEC_DIRS) -> list[str]:
    """Step 4: the host device nodes the names inject; ColdPlugError when one does not resolve."""
    registry = cdi.load_specs([host.path(d) for d in spec_dirs])
    nodes: list[str] = []
    unresolved = []
    for name in names:
        try:
            found = registry.resolve(name)
        except cdi.UnresolvedDeviceError:
            unresolved.append(name)
            continue
        for edits in (found.spec.container_edits, found.device.container_edits):
            # As the node names them (a hostPath below --runtime-root maps back).
            nodes += [host.host_node(n.host_path or n.path) for n in edits.device_nodes]
    if unresolved:
        raise ColdPlugError(f"unresolvable CDI devices {', '.join(unresolved)}")
    return list(dict.fromkeys(nodes))


def functions_of(host: HostRoot, node: str) -> list[str]:
    """Step 5: the PCI functions one injected device node cold-plugs."""
    if node in _PLUG_NOTHING:
        return []
    if node.startswith("/dev/vfio/devices/"):
        cdev = node.rsplit("/", 1)[1]
        devices = host.path("/sys/bus/pci/devices")
        owners = sorted(b for b in os.listdir(devices) if (devices / b / "vfio-dev" / cdev).exists())
        if len(owners) != 1:
            raise ColdPlugError(f"{node}: no single PCI device owns vfio cdev {cdev} ({owners})")
        return owners
    if node.startswith("/dev/vfio/"):
        group = node.rsplit("/", 1)[1]
        members = host.path(f"/sys/kernel/iommu_groups/{group}/devices")
        try:
            bdfs = sorted(os.listdir(members))
        except FileNotFoundError:
            raise ColdPlugError(f"{node}: IOMMU group {group} does not exist on the host") from None
        out = []
        for bdf in bdfs:
            pci_class = int((members / bdf / "class").read_text().strip(), 16) >> 8
            if pci_class not in _BRIDGE_CLASSES:
                out.append(bdf)
        return out
    return []


def cold_plug(host: HostRoot, socket: os.PathLike[str] | str, annotations: Mapping[str, str],
              sources: tuple[str, ...] = UPSTREAM_SOURCES) -> ColdPlug:
    """Everything the shim does for one pod sandbox, or ColdPlugError where it would fail."""
    names = pod_cdi_names(socket, annotations, sources)
    nodes = resolve(host, names)
    functions: list[str] = []
    for node in nodes:
        functions += functions_of(host, node)
    return ColdPlug(tuple(names), tuple(nodes), tuple(dict.fromkeys(functions)))


def sandbox_annotations(namespace: str, name: str) -> dict[str, str]:
    """What containerd's CRI puts on a pod sandbox."""
    return {NAME_ANNOTATIONS[0]: name, NAMESPACE_ANNOTATIONS[0]: namespace}
