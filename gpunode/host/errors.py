"""Errors raised while reading or changing the node's hardware state."""

from gpunode.errors import GpuNodeError


class HostError(GpuNodeError):
    """The host is not as expected, or a change to it failed (exit code 1)."""
