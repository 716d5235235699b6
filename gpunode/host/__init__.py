"""The node's hardware, read and changed through sysfs under a HostRoot."""

from gpunode.host.errors import HostError
from gpunode.host.root import HostRoot

__all__ = ["HostError", "HostRoot"]
