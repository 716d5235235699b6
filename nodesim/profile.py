"""Host profiles: a YAML description of a node's PCI devices (the files in ``examples/hosts/``).

A profile is what the simulator materialises (``nodesim.materialise``);
shipped ones are found by name through ``nodesim.profiles``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpunode.errors import ConfigError
from gpunode.host.pci import BDF_RE
from nodesim.fabricmanager import MODES as FM_MODES
from nodesim.fabricmanager import PLATFORMS as FM_PLATFORMS
from nodesim.fabricmanager import FabricManagerSpec
from nodesim.katadeploy import GO, SHIMS, KataInstall

VFIO_STATES = ("loaded", "loadable", "missing")


class ProfileError(ConfigError, ValueError):
    """A host profile that cannot describe a real node; the message names the entry."""


@dataclass(frozen=True)
class ProfileDevice:
    bdf: str
    vendor: int
    device: int
    class_code: int
    driver: str | None = None
    iommu_group: int | None = None
    numa_node: int = -1
    parent: str | None = None
    subsystem_vendor: int = 0
    subsystem_device: int = 0
    minor: int | None = None  # /dev/nvidia<minor> while on the nvidia driver
    # The CC mode a Hopper GPU booted into (its registers are emulated: nodesim.gpu),
    # and the PPCIe mode of a Hopper GPU or NVSwitch; None: the device has no such mode.
    cc_mode: str | None = None
    ppcie_mode: str | None = None
    # A PCI Express function (4096 bytes of config space) or a conventional PCI one (256):
    # Kata gives only the former a PCIe root port.
    pcie: bool = True


@dataclass(frozen=True)
class ProfileProcess:
    pid: int
    comm: str
    holds: tuple[str, ...]  # host paths of open device files


@dataclass(frozen=True)
class HostProfile:
    name: str
    iommu: bool
    devices: tuple[ProfileDevice, ...]
    iommufd: bool = False
    vfio_pci: str = "loadable"
    processes: tuple[ProfileProcess, ...] = field(default=())
    description: str = ""
    # Extra lines of the kernel's modules.alias, "vfio_pci:<pattern> <module>": the VFIO
    # variant drivers this kernel has (vfio-pci's own catch-all is always there).
    modules_alias: tuple[tuple[str, str], ...] = ()
    # Whether the host CPU runs confidential VMs (kvm_amd sev_snp or kvm_intel tdx set).
    cc_host: str | None = None
    # Kata as kata-deploy installs it (``nodesim.katadeploy``); None: no Kata on the node.
    kata: KataInstall | None = None
    # NVIDIA Fabric Manager running on the node (nodesim.fabricmanager); None: not running.
    fabric_manager: FabricManagerSpec | None = None


_DEVICE_KEYS = {
    "bdf", "vendor", "device", "class", "driver", "iommu_group", "numa_node", "parent",
    "subsystem_vendor", "subsystem_device", "minor", "cc_mode", "ppcie_mode", "pcie",
}
_TOP_KEYS = {"name", "description", "iommu", "iommufd", "vfio_pci", "devices", "processes", "modules_alias",
             "cc_host", "kata", "fabric_manager"}
_KATA_KEYS = {"installed_by", "release", "shims"}
KATA_INSTALLERS = ("kata-deploy",)
CC_MODES = ("off", "on", "devtools")
PPCIE_MODES = ("off", "on")
CC_HOSTS = ("snp", "tdx")


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ProfileError(f"{where} must be an integer (e.g. 0x10de), got {value!r}")
    try:
        return value if isinstance(value, int) else int(value, 0)
    except ValueError:
        raise ProfileError(f"{where} must be an integer (e.g. 0x10de), got {value!r}") from None


def parse_profile(data: Any, source: str = "profile") -> HostProfile:
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: a host profile is a mapping with 'name' and 'devices'")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ProfileError(f"{source}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_TOP_KEYS))}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ProfileError(f"{source}: 'name' must be a non-empty string")
    vfio = data.get("vfio_pci", "loadable")
    if vfio not in VFIO_STATES:
        raise ProfileError(f"{source}: vfio_pci {vfio!r} must be one of {', '.join(VFIO_STATES)}")
    raw_devices = data.get("devices")
    if not isinstance(raw_devices, list):
        raise ProfileError(f"{source}: 'devices' must be a list")
    devices = [_device(raw, f"{source}: devices[{i}]") for i, raw in enumerate(raw_devices)]
    seen: set[str] = set()
    for i, dev in enumerate(devices):
        if dev.bdf in seen:
            raise ProfileError(f"{source}: devices[{i}] repeats bdf {dev.bdf}")
        seen.add(dev.bdf)
    for i, dev in enumerate(devices):
        if dev.parent is not None and dev.parent not in seen:
            raise ProfileError(f"{source}: devices[{i}] parent {dev.parent} is not a device of this profile")
    _check_acyclic(devices, source)
    processes = tuple(_process(p, f"{source}: processes[{i}]") for i, p in enumerate(data.get("processes") or []))
    aliases = tuple(_alias(a, f"{source}: modules_alias[{i}]") for i, a in enumerate(data.get("modules_alias") or []))
    cc_host = data.get("cc_host")
    if cc_host is not None and cc_host not in CC_HOSTS:
        raise ProfileError(f"{source}: cc_host {cc_host!r} must be one of {', '.join(CC_HOSTS)} or null")
    return HostProfile(
        name=name,
        description=str(data.get("description", "")),
        iommu=bool(data.get("iommu", True)),
        iommufd=bool(data.get("iommufd", False)),
        vfio_pci=vfio,
        devices=tuple(devices),
        processes=processes,
        modules_alias=aliases,
        cc_host=cc_host,
        kata=None if data.get("kata") is None else _kata(data["kata"], f"{source}: kata"),
        fabric_manager=(None if data.get("fabric_manager") is None
                        else _fabric_manager(data["fabric_manager"], seen, f"{source}: fabric_manager")),
    )


def _fabric_manager(raw: Any, bdfs: set[str], where: str) -> FabricManagerSpec:
    """``fabric_manager: {platform: hgx-h100, mode: shared, module_ids: {1: '0000:03:00.0', ...}}``."""
    if not isinstance(raw, dict) or set(raw) - {"platform", "mode", "module_ids"}:
        raise ProfileError(f"{where} must be a mapping of platform, mode and module_ids")
    platform, mode = raw.get("platform", "hgx-h100"), raw.get("mode", "shared")
    if platform not in FM_PLATFORMS or mode not in FM_MODES:
        raise ProfileError(f"{where}: platform must be one of {', '.join(FM_PLATFORMS)} and mode one of "
                           f"{', '.join(FM_MODES)}, got {platform!r} and {mode!r}")
    ids = raw.get("module_ids") or {}
    if not isinstance(ids, dict) or any(not isinstance(k, int) or not 1 <= k <= 16 or str(v).lower() not in bdfs
                                        for k, v in ids.items()):
        raise ProfileError(f"{where}.module_ids must map module IDs 1-16 to devices of this profile")
    return FabricManagerSpec(platform, mode, {k: str(v).lower() for k, v in ids.items()})


def _kata(raw: Any, where: str) -> KataInstall:
    """``kata: {installed_by: kata-deploy, release: 3.29.0, shims: [go, runtime-rs]}``."""
    if not isinstance(raw, dict) or set(raw) - _KATA_KEYS:
        raise ProfileError(f"{where} must be a mapping of {', '.join(sorted(_KATA_KEYS))}")
    installed_by = raw.get("installed_by", "kata-deploy")
    if installed_by not in KATA_INSTALLERS:
        raise ProfileError(f"{where}.installed_by {installed_by!r} must be one of {', '.join(KATA_INSTALLERS)}")
    release = str(raw.get("release", ""))
    parts = release.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ProfileError(f"{where}.release {release!r} must be a Kata release such as 3.29.0")
    shims = raw.get("shims", [GO])
    if not isinstance(shims, list) or not shims or any(s not in SHIMS for s in shims):
        raise ProfileError(f"{where}.shims must be a list of {', '.join(SHIMS)}")
    return KataInstall(installed_by, release, tuple(dict.fromkeys(shims)))


def _alias(raw: Any, where: str) -> tuple[str, str]:
    parts = raw.split() if isinstance(raw, str) else []
    if len(parts) != 2 or not parts[0].startswith("vfio_pci:v") or "/" in parts[1]:
        raise ProfileError(f"{where} {raw!r} must be 'vfio_pci:v<VENDOR>d<DEVICE>... <module>', "
                           "as a line of modules.alias without its 'alias'")
    return parts[0], parts[1]


def _device(raw: Any, where: str) -> ProfileDevice:
    if not isinstance(raw, dict):
        raise ProfileError(f"{where} must be a mapping")
    unknown = sorted(set(raw) - _DEVICE_KEYS)
    if unknown:
        raise ProfileError(f"{where}: unknown key(s) {', '.join(unknown)}")
    for key in ("bdf", "vendor", "device", "class"):
        if key not in raw:
            raise ProfileError(f"{where}: missing {key!r}")
    bdf = str(raw["bdf"]).lower()
    if not BDF_RE.match(bdf):
        raise ProfileError(f"{where}: bdf {raw['bdf']!r} is not of the form 0000:0a:00.0")
    parent = raw.get("parent")
    if parent is not None:
        parent = str(parent).lower()
        if not BDF_RE.match(parent):
            raise ProfileError(f"{where}: parent {raw['parent']!r} is not of the form 0000:00:01.0")
    driver = raw.get("driver")
    if driver is not None and (not isinstance(driver, str) or "/" in driver or not driver):
        raise ProfileError(f"{where}: driver {driver!r} must be a driver name or null")
    group = raw.get("iommu_group")
    return ProfileDevice(
        bdf=bdf,
        vendor=_int(raw["vendor"], f"{where}.vendor"),
        device=_int(raw["device"], f"{where}.device"),
        class_code=_int(raw["class"], f"{where}.class"),
        driver=driver,
        iommu_group=None if group is None else _int(group, f"{where}.iommu_group"),
        numa_node=_int(raw.get("numa_node", -1), f"{where}.numa_node"),
        parent=parent,
        subsystem_vendor=_int(raw.get("subsystem_vendor", 0), f"{where}.subsystem_vendor"),
        subsystem_device=_int(raw.get("subsystem_device", 0), f"{where}.subsystem_device"),
        minor=None if raw.get("minor") is None else _int(raw["minor"], f"{where}.minor"),
        cc_mode=_choice(raw.get("cc_mode"), CC_MODES, f"{where}.cc_mode"),
        ppcie_mode=_choice(raw.get("ppcie_mode"), PPCIE_MODES, f"{where}.ppcie_mode"),
        pcie=_bool(raw.get("pcie", True), f"{where}.pcie"),
    )


def _choice(value: Any, allowed: tuple[str, ...], where: str) -> str | None:
    if value is None:
        return None
    if value not in allowed:
        raise ProfileError(f"{where} {value!r} must be one of {', '.join(allowed)}")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ProfileError(f"{where} must be true or false, got {value!r}")
    return value


def _process(raw: Any, where: str) -> ProfileProcess:
    if not isinstance(raw, dict) or "pid" not in raw:
        raise ProfileError(f"{where} must be a mapping with 'pid', 'comm' and 'holds'")
    holds = raw.get("holds") or []
    if not isinstance(holds, list) or not all(isinstance(h, str) and h.startswith("/dev/") for h in holds):
        raise ProfileError(f"{where}.holds must be a list of /dev paths")
    return ProfileProcess(pid=_int(raw["pid"], f"{where}.pid"), comm=str(raw.get("comm", "proc")), holds=tuple(holds))


def _check_acyclic(devices: list[ProfileDevice], source: str) -> None:
    parents = {d.bdf: d.parent for d in devices}
    for dev in devices:
        seen = {dev.bdf}
        node = dev.parent
        while node is not None:
            if node in seen:
                raise ProfileError(f"{source}: device {dev.bdf} has a parent cycle through {node}")
            seen.add(node)
            node = parents.get(node)


def load_profile(path: str | Path) -> HostProfile:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"host profile {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ProfileError(f"host profile {path} is not valid YAML: {exc}") from None
    return parse_profile(data, str(path))
