"""Container runtime wiring: containerd config edits, Kata config transform, reload."""

from katamgr.runtime.containerd import configure_containerd
from katamgr.runtime.containerd_files import ContainerdChange, KataRuntime
from katamgr.runtime.containerd_revert import check_entries, revert_containerd
from katamgr.runtime.kata_config import KataConfigResult, transform_kata_config
from katamgr.runtime.reload import ReloadResult, RestartMode, reload_containerd

__all__ = [
    "ContainerdChange",
    "KataConfigResult",
    "KataRuntime",
    "ReloadResult",
    "RestartMode",
    "check_entries",
    "configure_containerd",
    "reload_containerd",
    "revert_containerd",
    "transform_kata_config",
]
