"""What an artifact source gives the installer: manifest bytes and blob byte streams.

Two sources implement it, a registry (``remote.py``) and an OCI layout on disk
(``layout.py``); the installer verifies and writes what either of them yields.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, TypeVar

from .errors import ArtifactError
from .manifest import Layer

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class FetchedManifest:
    data: bytes  # the exact bytes, so their digest can be checked
    media_type: str | None  # Content-Type or the index descriptor's mediaType
    expected_digest: str | None  # the ref's digest (registry) or the index's (layout)


class Source(Protocol):
    description: str  # the ref as the operator wrote it, for messages

    def fetch_manifest(self) -> FetchedManifest: ...

    def open_blob(self, layer: Layer) -> AbstractContextManager[Iterator[bytes]]: ...


class TransientError(ArtifactError):
    """A failure worth retrying: connection refused/reset/timed out, or an HTTP 5xx."""

    def __init__(self, problem: str, fix: str, *, unreachable: bool) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem = problem
        self.fix = fix
        self.unreachable = unreachable  # no answer at all (vs. a 5xx or a dropped stream)


class SourceUnreachable(ArtifactError):
    """The source did not answer after every retry (connection refused or timed out)."""


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 3  # attempts after the first
    backoff: float = 0.5  # seconds before the first retry; doubles each time


def with_retries(policy: RetryPolicy, attempt: Callable[[], T]) -> T:
    """Run ``attempt``, retrying TransientError with exponential backoff; other errors pass."""
    for number in range(policy.retries + 1):
        try:
            return attempt()
        except TransientError as exc:
            if number == policy.retries:
                message = f"{exc.problem} (tried {number + 1} times); {exc.fix}"
                if exc.unreachable:
                    raise SourceUnreachable(message) from exc
                raise ArtifactError(message) from exc
            delay = policy.backoff * (2**number)
            log.warning("%s; retry %d of %d in %.1fs", exc.problem, number + 1, policy.retries,
                        delay)
            time.sleep(delay)
    raise AssertionError("unreachable")  # the loop always returns or raises
