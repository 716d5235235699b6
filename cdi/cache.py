"""Load every spec from the spec directories and resolve qualified device names.

Override order (as the CDI specification defines it): directories are listed from
lowest to highest priority, so with the default ``("/etc/cdi", "/var/run/cdi")`` a
device in ``/var/run/cdi`` overrides the same qualified name from ``/etc/cdi``. Two
specs in the *same* directory that define the same qualified name conflict: the device
is dropped and the error is recorded against both files. A file that cannot be read or
is invalid contributes no devices and its error is recorded; loading never stops on a
bad file.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cdi.errors import CDIError, SpecFileError
from cdi.files import FORMATS, read_spec
from cdi.model import Device, Spec
from cdi.names import parse_qualified_name

log = logging.getLogger(__name__)

STATIC_SPEC_DIR = "/etc/cdi"
DYNAMIC_SPEC_DIR = "/var/run/cdi"
DEFAULT_SPEC_DIRS = (STATIC_SPEC_DIR, DYNAMIC_SPEC_DIR)


class UnresolvedDeviceError(CDIError):
    """A qualified device name is not defined (or is ambiguous) in the loaded specs."""

    def __init__(self, device: str, message: str) -> None:
        self.device = device
        super().__init__(message)


@dataclass(frozen=True)
class LoadedSpec:
    """A valid spec and where it came from (``priority`` = index of its directory)."""

    spec: Spec
    path: Path
    priority: int


@dataclass(frozen=True)
class ResolvedDevice:
    qualified_name: str
    device: Device
    source: LoadedSpec

    @property
    def spec(self) -> Spec:
        return self.source.spec


@dataclass(frozen=True)
class SpecRegistry:
    """The outcome of one scan of the spec directories (call ``load_specs`` to rescan)."""

    dirs: tuple[Path, ...]
    specs: tuple[LoadedSpec, ...]
    devices: dict[str, ResolvedDevice]
    # path of a file or directory -> the problems found there
    errors: dict[str, list[str]] = field(default_factory=dict)
    conflicts: dict[str, tuple[Path, ...]] = field(default_factory=dict)

    def get(self, device: str) -> ResolvedDevice | None:
        return self.devices.get(device)

    def __contains__(self, device: object) -> bool:
        return device in self.devices

    def resolve(self, device: str) -> ResolvedDevice:
        """The device behind a qualified name like ``nvidia.com/pgpu=0``.

        Raises InvalidNameError for a malformed name and UnresolvedDeviceError when no
        spec defines it (or two specs in one directory both do).
        """
        found = self.devices.get(device)
        if found is not None:
            return found
        parse_qualified_name(device)
        if device in self.conflicts:
            files = ", ".join(str(p) for p in self.conflicts[device])
            raise UnresolvedDeviceError(device, f"CDI device {device!r} is defined by more than "
                                                f"one spec in the same directory ({files}); "
                                                "remove all but one")
        where = ", ".join(str(d) for d in self.dirs) or "no directories"
        raise UnresolvedDeviceError(device, f"CDI device {device!r} is not defined by any valid "
                                            f"spec in {where}")

    def device_names(self) -> list[str]:
        return sorted(self.devices)

    def vendors(self) -> list[str]:
        return sorted({s.spec.vendor for s in self.specs})

    def classes(self) -> list[str]:
        return sorted({s.spec.class_ for s in self.specs})


def _spec_files(directory: Path, errors: dict[str, list[str]]) -> list[Path]:
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    except OSError as err:
        errors.setdefault(str(directory), []).append(
            f"CDI spec directory {directory} cannot be listed: {err.strerror or err}")
        return []
    files = []
    for entry in entries:
        # Subdirectories are skipped, like the reference; temp files end in .tmp.
        if entry.name.rpartition(".")[2] in FORMATS and not entry.is_dir():
            files.append(Path(entry.path))
    return files


def load_specs(dirs: Iterable[str | os.PathLike[str]] = DEFAULT_SPEC_DIRS) -> SpecRegistry:
    """Scan ``dirs`` (lowest priority first) and index their devices by qualified name."""
    directories = tuple(Path(d) for d in dirs)
    errors: dict[str, list[str]] = {}
    specs: list[LoadedSpec] = []
    devices: dict[str, ResolvedDevice] = {}
    conflicts: dict[str, list[Path]] = {}
    for priority, directory in enumerate(directories):
        for path in _spec_files(directory, errors):
            try:
                spec = read_spec(path)
            except SpecFileError as err:
                log.warning("%s", err)
                errors.setdefault(str(path), []).append(str(err))
                continue
            loaded = LoadedSpec(spec=spec, path=path, priority=priority)
            specs.append(loaded)
            for device in spec.devices:
                name = f"{spec.kind}={device.name}"
                other = devices.get(name)
                if other is not None and other.source.priority == priority:
                    message = (f"CDI device {name!r} is defined both in {other.source.path} and "
                               f"in {path}")
                    for p in (other.source.path, path):
                        errors.setdefault(str(p), []).append(message)
                    conflicts.setdefault(name, [other.source.path]).append(path)
                    continue
                if other is not None:
                    log.debug("CDI device %s from %s overrides %s", name, path,
                              other.source.path)
                # A higher-priority directory settles a conflict of a lower one.
                conflicts.pop(name, None)
                devices[name] = ResolvedDevice(qualified_name=name, device=device, source=loaded)
    for name in conflicts:
        devices.pop(name, None)
    return SpecRegistry(dirs=directories, specs=tuple(specs), devices=devices, errors=errors,
                        conflicts={k: tuple(v) for k, v in conflicts.items()})
