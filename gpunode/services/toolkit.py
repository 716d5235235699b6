"""What the NVIDIA Container Toolkit's config says about who may pick GPUs.

On a container node the toolkit (nvidia-container-runtime and its hook) reads
``/etc/nvidia-container-runtime/config.toml``. Its top-level key
``accept-nvidia-visible-devices-envvar-when-unprivileged`` decides whether an
unprivileged container's own ``NVIDIA_VISIBLE_DEVICES`` is obeyed; missing, it
is true (the toolkit's default), so any pod can set the variable and get GPUs
it never requested. ``read_toolkit_config`` is a pure read through a HostRoot:
a missing or unreadable file is a note, never an exception.
"""

from __future__ import annotations

import os
import stat
import tomllib
from dataclasses import dataclass, field

from gpunode.host.root import HostRoot

TOOLKIT_CONFIG = "/etc/nvidia-container-runtime/config.toml"
ENVVAR_WHEN_UNPRIVILEGED = "accept-nvidia-visible-devices-envvar-when-unprivileged"
AS_VOLUME_MOUNTS = "accept-nvidia-visible-devices-as-volume-mounts"
# A config is a few KiB; refuse to read something that is not one.
MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class ToolkitConfig:
    path: str  # as the host sees it
    read: bool  # the file was there and parsed: the settings below are what it says
    # The key's value as written (None: not set, or the file was not read).
    envvar_when_unprivileged: object = None
    volume_mounts: object = None
    notes: list[str] = field(default_factory=list)

    @property
    def unprivileged_may_pick_gpus(self) -> bool:
        """Whether the runtime obeys an unprivileged container's NVIDIA_VISIBLE_DEVICES:
        anything but a literal ``false`` (missing: the toolkit's default, true)."""
        return self.envvar_when_unprivileged is not False

    def to_json(self) -> dict[str, object]:
        return {
            "config": self.path,
            "read": self.read,
            ENVVAR_WHEN_UNPRIVILEGED: self.envvar_when_unprivileged,
            AS_VOLUME_MOUNTS: self.volume_mounts,
            "notes": list(self.notes),
        }


def read_toolkit_config(host: HostRoot, path: str = TOOLKIT_CONFIG) -> ToolkitConfig:
    local = host.path(path)
    try:
        st = os.stat(local)
    except FileNotFoundError:
        return ToolkitConfig(path, False, notes=[
            f"{path} does not exist, so the NVIDIA Container Toolkit's settings were not checked "
            "(a toolkit installed by the GPU Operator keeps its config under /usr/local/nvidia/toolkit)"])
    except OSError as exc:
        return ToolkitConfig(path, False, notes=[f"{path} could not be read ({exc.strerror}); "
                                                 "its settings were not checked"])
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_CONFIG_BYTES:
        return ToolkitConfig(path, False, notes=[f"{path} is not a regular file of at most "
                                                 f"{MAX_CONFIG_BYTES} bytes; its settings were not checked"])
    try:
        data = tomllib.loads(local.read_bytes().decode())
    except OSError as exc:
        return ToolkitConfig(path, False, notes=[f"{path} could not be read ({exc.strerror}); "
                                                 "its settings were not checked"])
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        return ToolkitConfig(path, False, notes=[f"{path} is not valid TOML ({exc}); "
                                                "its settings were not checked"])
    envvar = data.get(ENVVAR_WHEN_UNPRIVILEGED)
    notes = []
    if envvar is not None and not isinstance(envvar, bool):
        notes.append(f"{path}: {ENVVAR_WHEN_UNPRIVILEGED} is {envvar!r}, not a boolean")
    return ToolkitConfig(path, True, envvar, data.get(AS_VOLUME_MOUNTS), notes)


def toml_value(value: object) -> str:
    """A setting's value as TOML writes it (``true``, ``"false"``)."""
    if isinstance(value, bool):
        return str(value).lower()
    return f'"{value}"' if isinstance(value, str) else repr(value)


def isolation_problem(config: ToolkitConfig) -> str | None:
    """The plan's problem line when unprivileged pods may pick GPUs; None when they cannot
    or the file was not read (that is a note)."""
    if not config.read or not config.unprivileged_may_pick_gpus:
        return None
    now = ("is not set (the toolkit's default is true)" if config.envvar_when_unprivileged is None
           else f"is {toml_value(config.envvar_when_unprivileged)}")
    return (f"{config.path}: {ENVVAR_WHEN_UNPRIVILEGED} {now}; set it to false, or any unprivileged "
            "pod can pick GPUs it did not request by setting NVIDIA_VISIBLE_DEVICES itself. With "
            "false a device plugin's envvar strategy gives unprivileged pods no GPU: run sandbox-device-plugin "
            f"with --device-list-strategy volume-mounts (and {AS_VOLUME_MOUNTS} = true in the same "
            "file) or a CDI strategy (cdi-cri, cdi-annotations)")
