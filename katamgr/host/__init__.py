"""The node's hardware, read and changed through sysfs under a HostRoot."""

from katamgr.host.errors import HostError
from katamgr.host.root import HostRoot

__all__ = ["HostError", "HostRoot"]
