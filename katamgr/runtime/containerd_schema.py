"""Where containerd keeps what we touch, per config version.

Version 2 (containerd 1.x, still read by 2.x) keeps runtimes and CDI under the CRI
plugin ``io.containerd.grpc.v1.cri``; version 3 (containerd 2.x) moved both to
``io.containerd.cri.v1.runtime`` (checked against containerd 2.x's documented
default config, see tests/data/containerd/containerd2-default.toml). Version 4
(containerd 2.3) moved only server-level settings into plugins; the CRI runtime
plugin stays where version 3 put it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpunode.errors import ConfigError

SUPPORTED_VERSIONS = (2, 3, 4)
KATA_RUNTIME_TYPE = "io.containerd.kata.v2"
CDI_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")


@dataclass(frozen=True)
class Layout:
    version: int
    plugin: str  # the plugin table that holds `containerd.runtimes` and the CDI switches

    @property
    def plugin_path(self) -> tuple[str, ...]:
        return ("plugins", self.plugin)

    def runtime_path(self, name: str) -> tuple[str, ...]:
        return (*self.plugin_path, "containerd", "runtimes", name)

    @property
    def enable_cdi_path(self) -> tuple[str, ...]:
        return (*self.plugin_path, "enable_cdi")

    @property
    def cdi_spec_dirs_path(self) -> tuple[str, ...]:
        return (*self.plugin_path, "cdi_spec_dirs")


LAYOUTS = {
    2: Layout(2, "io.containerd.grpc.v1.cri"),
    3: Layout(3, "io.containerd.cri.v1.runtime"),
    4: Layout(4, "io.containerd.cri.v1.runtime"),
}


def layout_for(version: int) -> Layout:
    try:
        return LAYOUTS[version]
    except KeyError:
        raise ConfigError(
            f"containerd config version {version} is not supported; use 2 (containerd 1.x), "
            f"3 (containerd 2.0-2.2) or 4 (containerd 2.3)"
        ) from None


def detect_version(doc: Mapping[str, Any], path: str, forced: int | None) -> int:
    """The config version of an existing, non-empty config file.

    A file without ``version`` is version 1 to containerd (plugin names ``cri``,
    ``linux``): entries written in version 2 form would be silently ignored, and adding
    ``version = 2`` would reinterpret the operator's other settings. So we refuse.
    """
    raw = doc.get("version")
    if raw is None:
        raise ConfigError(
            f"{path} has no 'version' key, which containerd reads as the deprecated config "
            f"version 1; convert it with 'containerd config migrate' or add 'version = 2' "
            f"after checking its plugin names"
        )
    if not isinstance(raw, int) or isinstance(raw, bool):
        raise ConfigError(f"{path} has version = {raw!r}; expected the integer 2, 3 or 4")
    version = int(raw)
    layout_for(version)
    if forced is not None and forced != version:
        raise ConfigError(
            f"{path} is containerd config version {version} but version {forced} was "
            f"requested; drop the forced version or migrate the file"
        )
    return version
