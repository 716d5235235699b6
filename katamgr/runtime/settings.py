"""The containerd settings an operator chooses (``kataManager.config.containerd``), typed once.

The config model, the containerd edit, the reload and the chart's schema all take the
restart modes and the defaults from here.
"""

from __future__ import annotations

from enum import StrEnum


class RestartMode(StrEnum):
    """How containerd is made to load a changed config (GPU Operator ``restartMode``)."""

    SIGNAL = "signal"  # SIGHUP to the process holding containerd's socket
    SYSTEMD = "systemd"  # systemctl restart containerd (through chroot off the real root)
    NONE = "none"  # only log that the operator must restart containerd


DEFAULT_CONFIG_PATH = "/etc/containerd/config.toml"
DEFAULT_SOCKET = "/run/containerd/containerd.sock"
DEFAULT_RESTART_MODE = RestartMode.SIGNAL
DEFAULT_POD_ANNOTATIONS = ("io.katacontainers.*",)
DEFAULT_UNIT = "containerd"
# Config versions an operator may force (null: detect from the existing file).
CONFIGURABLE_VERSIONS = (2, 3)
