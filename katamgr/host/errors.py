"""Errors raised while reading or changing the node's hardware state."""


class HostError(Exception):
    """The host is not as expected, or a change to it failed (exit code 1)."""

    exit_code = 1
