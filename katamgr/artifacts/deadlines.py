"""How long each network step of a pull may take.

Apart from the registry client so that code which only plans (and never
pulls) does not import the HTTP and OCI client libraries.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Deadlines:
    """Seconds each network step may take; the defaults suit a GPU node's artifacts."""

    connect: float = 10.0  # TCP (and TLS) connect
    read: float = 60.0  # the wait for any one read
    manifest: float = 60.0  # a whole manifest request, headers and body
    blob: float = 1800.0  # a whole blob (a 500 MB initrd at 0.3 MB/s)


DEFAULT_DEADLINES = Deadlines()
