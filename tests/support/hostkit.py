"""Building simulated hosts in tests, and comparing their state."""

from __future__ import annotations

import json
import os
from pathlib import Path

from gpunode.host.root import HostRoot
from nodesim.marker import MARKER
from nodesim.materialise import materialise
from nodesim.profile import parse_profile

GPU_A10 = {"vendor": 0x10DE, "device": 0x2236, "class": 0x030200}
GPU_A6000 = {"vendor": 0x10DE, "device": 0x2230, "class": 0x030000}
AUDIO_A6000 = {"vendor": 0x10DE, "device": 0x1AEF, "class": 0x040300}
NIC_I210 = {"vendor": 0x8086, "device": 0x1533, "class": 0x020000}
ROOT_PORT = {"vendor": 0x8086, "device": 0x460D, "class": 0x060400}


def dev(bdf: str, kind: dict, driver: str | None, group: int | None, **extra) -> dict:
    return {"bdf": bdf, **kind, "driver": driver, "iommu_group": group, "numa_node": 0, **extra}


def make_host(tmp_path: Path, devices: list[dict], **profile) -> HostRoot:
    data = {"name": profile.pop("name", "test-host"), "iommu": True, "vfio_pci": "loaded", "devices": devices, **profile}
    return materialise(parse_profile(data), tmp_path / "host")


def tune(host: HostRoot, **settings) -> None:
    """Change the emulated kernel's behaviour (fail_probe, udev_delay_ms...)."""
    marker = host.root / MARKER
    data = json.loads(marker.read_text())
    data.update(settings)
    marker.write_text(json.dumps(data))


def snapshot(host: HostRoot) -> dict[str, str]:
    """Every file's content and every link's target under sys/ and dev/ (but the
    simulator's own settings file, which only the emulated kernel writes)."""
    state = {}
    for top in ("sys", "dev"):
        for dirpath, dirnames, filenames in os.walk(host.root / top):
            for name in dirnames + filenames:
                path = Path(dirpath) / name
                rel = str(path.relative_to(host.root))
                if rel == MARKER:
                    continue
                if path.is_symlink():
                    state[rel] = "-> " + os.readlink(path)
                elif path.is_file():
                    # config and resourceN are binary, as on a node
                    state[rel] = path.read_bytes().decode("latin-1")
                else:
                    state[rel] = "<dir>"
    return state


def driver_of(host: HostRoot, bdf: str) -> str | None:
    link = host.path(f"/sys/bus/pci/devices/{bdf}/driver")
    return Path(os.readlink(link)).name if link.is_symlink() else None


def hold(host: HostRoot, group: int | str, pid: int = 7777) -> Path:
    """A QEMU of a running Kata VM holding /dev/vfio/<group>, as the node's /proc shows it
    (what katamgr's and the plugin's holder checks read); the fd link, to remove when the VM ends."""
    fd_dir = host.path(f"/proc/{pid}/fd")
    fd_dir.mkdir(parents=True)
    (fd_dir.parent / "comm").write_text("qemu-system-x86\n")
    (fd_dir / "12").symlink_to(f"/dev/vfio/{group}")
    return fd_dir / "12"
