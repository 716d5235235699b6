"""Errors raised while reading or changing the node's hardware state."""

from katamgr.errors import KatamgrError


class HostError(KatamgrError):
    """The host is not as expected, or a change to it failed (exit code 1)."""
