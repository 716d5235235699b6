"""Model names from the pci.ids database (resource names made of them: ``naming``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# Debian's hwdata first, then the older pciutils location.
DEFAULT_PCI_IDS = ("/usr/share/hwdata/pci.ids", "/usr/share/misc/pci.ids")


# NVIDIA's NVSwitches, named as pci.ids (pci-ids.ucw.cz, vendor 10de) names them: a node's
# hwdata older than the switch (Debian 12's is from 2023-04 and lacks 22a3) would show a
# DGX's NVSwitches as bare ids beside named GPUs. Shown only; never part of a resource name.
KNOWN_MODELS: dict[tuple[int, int], str] = {
    (0x10DE, 0x1AF1): "GA100 [A100 NVSwitch]",
    (0x10DE, 0x22A3): "GH100 [H100 NVSwitch]",
}


def known_model(vendor: int, device: int) -> str | None:
    return KNOWN_MODELS.get((vendor, device))


@dataclass
class PciIds:
    """Device names of the vendors we were asked about, read lazily."""

    path: Path | None
    _names: dict[int, dict[int, str]] = field(default_factory=dict, repr=False)

    @classmethod
    def find(cls, override: str | Path | None = None) -> PciIds:
        """The database at ``override``, else the system's; an absent file gives
        an empty database (every name falls back to the hex id)."""
        if override:
            path = Path(override)
            if not path.exists():
                raise FileNotFoundError(f"pci.ids file {path} does not exist; pass an existing file or omit --pci-ids")
            if not path.is_file():
                what = "a directory" if path.is_dir() else "not a regular file (a device, pipe or socket)"
                raise FileNotFoundError(f"pci.ids file {path} is {what}; pass the pci.ids database file "
                                        f"(the system's is {' or '.join(DEFAULT_PCI_IDS)}) or omit --pci-ids")
            return cls(path)
        for candidate in DEFAULT_PCI_IDS:
            if Path(candidate).is_file():
                return cls(Path(candidate))
        return cls(None)

    def device_name(self, vendor: int, device: int) -> str | None:
        if vendor not in self._names:
            self._names[vendor] = self._load_vendor(vendor)
        return self._names[vendor].get(device)

    def _load_vendor(self, vendor: int) -> dict[int, str]:
        if self.path is None:
            return {}
        wanted = f"{vendor:04x}"
        names: dict[int, str] = {}
        inside = False
        with open(self.path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line.strip() or line.startswith("#"):
                    continue
                if not line.startswith("\t"):
                    if inside:
                        break
                    inside = line[:4].lower() == wanted and line[4:6] == "  "
                    continue
                if inside and not line.startswith("\t\t"):
                    ident, _, name = line.strip().partition("  ")
                    try:
                        names[int(ident, 16)] = name.strip()
                    except ValueError:
                        continue
        return names
