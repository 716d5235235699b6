"""Materialise a host profile as a host root with the kernel's sysfs shape.

The result is read by exactly the same code as a real node: devices live under
``sys/devices/pci<domain>:<bus>/...`` with ``sys/bus/pci/devices/<bdf>``
symlinks, ``driver`` and ``iommu_group`` links, group member links, and
``dev/vfio`` nodes as plain files (character devices with ``real_device_nodes``). The
root carries the emulated kernel (``nodesim.kernel``), which answers binding
writes and module loads; its settings file (``nodesim.marker.MARKER``, ``sys/katamgr-simulated-host``)
is how ``nodesim.node.open_node`` tells a simulated root from a real one.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path

from gpunode.errors import ConfigError
from gpunode.host.root import HostRoot
from nodesim import fabricmanager, gpuregs, katadeploy, kernel, pcifiles, udev
from nodesim.marker import MARKER
from nodesim.profile import HostProfile, ProfileDevice

log = logging.getLogger(__name__)


def materialise(profile: HostProfile, into: str | Path, *, real_device_nodes: bool = False) -> HostRoot:
    """Write ``profile`` into ``into``. With ``real_device_nodes`` (root only) its
    ``/dev/vfio`` nodes are character devices that reach no device, so a real
    container runtime here can inject them, and they are kept by a udev stand-in on this
    machine (``python -m nodesim.udev ROOT``) rather than by the emulated kernel:
    the local node of hack/local-cluster, whose pods run with ``--runtime-root`` set to
    this root."""
    root = Path(into).resolve()
    if real_device_nodes and os.geteuid() != 0:
        raise ConfigError("--real-device-nodes makes character devices: run it as root")
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"{root} is not empty; simulate into a new or empty directory")
    root.mkdir(parents=True, exist_ok=True)
    host = HostRoot(root, kernel.EMULATED)
    by_bdf = {d.bdf: d for d in profile.devices}

    drivers = {d.driver for d in profile.devices if d.driver}
    if profile.vfio_pci == "loaded":
        drivers.add(kernel.VFIO)
    bus = host.path("/sys/bus/pci")
    for name in sorted(drivers):
        kernel.create_driver_dir(host, name)
    (bus / "devices").mkdir(parents=True, exist_ok=True)
    (bus / "drivers_probe").write_text("")
    (bus / "rescan").write_text("")
    if profile.iommu:
        host.path("/sys/kernel/iommu_groups").mkdir(parents=True, exist_ok=True)
        host.path("/sys/class/iommu/dmar0").mkdir(parents=True, exist_ok=True)
    host.path("/dev").mkdir(parents=True, exist_ok=True)
    if profile.iommufd:
        host.path("/dev/iommu").write_text("")

    for dev in profile.devices:
        _create_device(host, profile, dev, by_bdf)

    marker = {
        "profile": profile.name,
        "vfio_pci": profile.vfio_pci,
        "iommufd": profile.iommufd,
        # What the kernel would pick on drivers_probe with no override: the
        # profile's driver stands in for modalias matching.
        "native_drivers": {d.bdf: d.driver for d in profile.devices if d.driver and d.driver != kernel.VFIO},
        "fail_probe": [],
        "udev_delay_ms": 0,
        # The Hopper GPUs' and NVSwitches' modes (nodesim.gpu), and its faults.
        "cc": {d.bdf: {"cc": d.cc_mode, "ppcie": d.ppcie_mode} for d in profile.devices
               if d.cc_mode is not None or d.ppcie_mode is not None},
        "cc_faults": {"stage": [], "readback": {}},
        "modules_alias": [list(a) for a in profile.modules_alias],
        # What a boot gives again (nodesim.reboot): each device's driver, vfio-pci loaded or not.
        "boot": {"drivers": {d.bdf: d.driver for d in profile.devices if d.driver}, "vfio_pci": profile.vfio_pci},
    }
    if real_device_nodes:
        marker["real_device_nodes"] = True
    (root / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    if profile.vfio_pci == "loaded":
        host.path("/dev/vfio").mkdir()
        kernel.make_node(host, host.path("/dev/vfio/vfio"))
    if real_device_nodes:
        host.path("/dev/vfio").mkdir(exist_ok=True)  # the chart mounts it

    for dev in profile.devices:
        if dev.driver == kernel.VFIO:
            kernel.on_vfio_bound(host, dev.bdf)
    _create_proc(host, profile)
    _create_kernel_files(host, profile)
    if profile.kata is not None:
        katadeploy.lay_out(host, profile.kata)
    if profile.fabric_manager is not None:
        try:
            fabricmanager.start(host.root, profile.fabric_manager)
        except fabricmanager.FabricManagerStandInError as e:
            # A machine without a C compiler (the chart's image): the node runs without FM,
            # and katamgr plan says what that means for its NVLink fabric.
            log.warning("%s; the simulated %s runs without Fabric Manager", e, profile.name)
    if real_device_nodes:
        udev.sync(host)
    return host


SIMULATED_RELEASE = "6.8.0-katamgr-simulated"
_CC_HOST_PARAMETER = {"snp": "/sys/module/kvm_amd/parameters/sev_snp", "tdx": "/sys/module/kvm_intel/parameters/tdx"}


def _create_kernel_files(host: HostRoot, profile: HostProfile) -> None:
    """The running kernel's release and its modules.alias (vfio-pci's catch-all and the
    profile's variant drivers, as depmod writes them); a CC host's KVM parameter."""
    host.path("/proc/sys/kernel").mkdir(parents=True, exist_ok=True)
    host.path("/proc/sys/kernel/osrelease").write_text(SIMULATED_RELEASE + "\n")
    modules = host.path(f"/lib/modules/{SIMULATED_RELEASE}")
    modules.mkdir(parents=True, exist_ok=True)
    lines = [f"alias {pattern} {module}" for pattern, module in profile.modules_alias]
    lines.append("alias vfio_pci:v*d*sv*sd*bc*sc*i* vfio_pci")
    (modules / "modules.alias").write_text("\n".join(lines) + "\n")
    if profile.cc_host:
        parameter = host.path(_CC_HOST_PARAMETER[profile.cc_host])
        parameter.parent.mkdir(parents=True, exist_ok=True)
        parameter.write_text("Y\n")


def _sysfs_dir(dev: ProfileDevice, by_bdf: dict[str, ProfileDevice]) -> str:
    chain = [dev.bdf]
    node = dev.parent
    while node is not None:
        chain.append(node)
        node = by_bdf[node].parent
    top = chain[-1]
    domain, busno = top.split(":")[0:2]
    return "/sys/devices/pci{}:{}/{}".format(domain, busno, "/".join(reversed(chain)))


def _create_device(host: HostRoot, profile: HostProfile, dev: ProfileDevice, by_bdf) -> None:
    directory = host.path(_sysfs_dir(dev, by_bdf))
    directory.mkdir(parents=True, exist_ok=True)
    attrs = {
        "vendor": f"0x{dev.vendor:04x}",
        "device": f"0x{dev.device:04x}",
        "subsystem_vendor": f"0x{dev.subsystem_vendor:04x}",
        "subsystem_device": f"0x{dev.subsystem_device:04x}",
        "class": f"0x{dev.class_code:06x}",
        "numa_node": str(dev.numa_node),
        "driver_override": "(null)",
        "enable": "1",
    }
    for name, value in attrs.items():
        (directory / name).write_text(value + "\n")
    kernel.write_uevent(directory, dev.bdf, dev.vendor, dev.device, dev.class_code,
                           dev.subsystem_vendor, dev.subsystem_device, None)
    emulated = dev.cc_mode is not None or dev.ppcie_mode is not None
    pcifiles.write_files(directory, dev, by_bdf, bars=emulated)
    if emulated and dev.device in gpuregs.GH100_IDS:
        gpuregs.boot(directory / "resource0", dev.cc_mode or "off", dev.ppcie_mode or "off")
    kernel.relative_link(directory, host.path(f"/sys/bus/pci/devices/{dev.bdf}"))
    if profile.iommu and dev.iommu_group is not None:
        group_dir = host.path(f"/sys/kernel/iommu_groups/{dev.iommu_group}/devices")
        group_dir.mkdir(parents=True, exist_ok=True)
        (group_dir.parent / "type").write_text("DMA\n")
        kernel.relative_link(group_dir.parent, directory / "iommu_group")
        kernel.relative_link(directory, group_dir / dev.bdf)
    if dev.driver:
        kernel.link_driver(host, dev.bdf, dev.driver)
    if dev.driver == "nvidia" and dev.vendor == 0x10DE:
        # As the driver writes it; the UUID is the one the simulated NVML gives (nodesim.nvml).
        info = host.path(f"/proc/driver/nvidia/gpus/{dev.bdf}/information")
        info.parent.mkdir(parents=True, exist_ok=True)
        minor = f"Device Minor: \t {dev.minor}\n" if dev.minor is not None else ""
        info.write_text(f"Model: \t\t simulated\nGPU UUID: \t GPU-{uuid.uuid5(uuid.NAMESPACE_OID, dev.bdf)}\n"
                        f"{minor}Bus Location: \t {dev.bdf}\n")


def _create_proc(host: HostRoot, profile: HostProfile) -> None:
    for proc in profile.processes:
        fd_dir = host.path(f"/proc/{proc.pid}/fd")
        fd_dir.mkdir(parents=True, exist_ok=True)
        (fd_dir.parent / "comm").write_text(proc.comm + "\n")
        for number, target in enumerate(proc.holds, start=3):
            # Like the real /proc: the link text is the host path of the open file.
            os.symlink(target, fd_dir / str(number))
