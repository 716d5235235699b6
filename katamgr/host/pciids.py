"""Model names from the pci.ids database, and resource names made from them."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

# Debian's hwdata first, then the older pciutils location.
DEFAULT_PCI_IDS = ("/usr/share/hwdata/pci.ids", "/usr/share/misc/pci.ids")

RESOURCE_VENDOR = "nvidia.com"
_MAX_NAME = 63
_DROP = re.compile(r"[^A-Za-z0-9_-]")
# Brackets separate too: pci.ids spells some models "GH100[H100 SXM5 80GB]".
_SEPARATORS = re.compile(r"[/.\s\[\]()]+")
_REPEATS = re.compile(r"_+")
_EDGE = re.compile(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$")
_ALIAS = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?$")


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
            if not path.is_file():
                raise FileNotFoundError(f"pci.ids file {path} does not exist; pass an existing file or omit --pci-ids")
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


def format_resource_suffix(model: str) -> str:
    """``GA102GL [A10]`` -> ``GA102GL_A10``: a valid extended-resource name part.

    Upper case; ``/``, ``.``, whitespace and brackets become ``_`` (one at a time);
    anything else outside ``[A-Za-z0-9_-]`` is dropped.
    """
    text = _SEPARATORS.sub("_", model.upper())
    text = _REPEATS.sub("_", _DROP.sub("", text))
    text = _EDGE.sub("", text)
    if len(text) > _MAX_NAME:
        text = _EDGE.sub("", text[:_MAX_NAME])
    return text


def resource_name(pci_ids: PciIds, vendor: int | None, device: int | None, alias: str | None = None) -> str:
    """The extended resource a device is advertised under."""
    if alias:
        return f"{RESOURCE_VENDOR}/{alias}"
    model = pci_ids.device_name(vendor, device) if vendor is not None and device is not None else None
    suffix = format_resource_suffix(model) if model else ""
    if not suffix:
        suffix = f"{device:04X}" if device is not None else "UNKNOWN"
    return f"{RESOURCE_VENDOR}/{suffix}"


def validate_alias(alias: str) -> str:
    """An alias must already be a valid name part: we never rewrite what the operator typed."""
    if not _ALIAS.match(alias or ""):
        raise ValueError(
            f"alias {alias!r} is not a valid resource name (letters, digits, '-', '_'; "
            f"start and end with a letter or digit; at most {_MAX_NAME} characters)"
        )
    return alias
