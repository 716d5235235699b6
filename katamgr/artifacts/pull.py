"""An artifact to pull and how: ``Pull``, the one place its options live.

Resolving an artifact (``install.resolve_artifact``: read-only, before anything is
written) and installing it (``install.install_artifact``) take the same reference, the same
credentials and the same bounds; they take them as one ``Pull``, so the two cannot be
handed different ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .credentials import Credentials
from .deadlines import DEFAULT_DEADLINES, Deadlines
from .layout import LayoutSource
from .manifest import DEFAULT_MAX_LAYER_BYTES
from .refs import ArtifactRef, LayoutRef, parse_ref
from .source import RetryPolicy, Source


@dataclass(frozen=True)
class Pull:
    ref: ArtifactRef
    label: str  # the reference as the operator wrote it: recorded and used in messages
    credentials: Credentials | None = None
    insecure_registries: tuple[str, ...] = ()
    retries: int = 3
    backoff: float = 0.5
    max_layer_bytes: int = DEFAULT_MAX_LAYER_BYTES
    deadlines: Deadlines = DEFAULT_DEADLINES

    @classmethod
    def of(cls, ref: str | ArtifactRef | Pull, *, label: str | None = None,
           insecure_registries: Iterable[str] = (), **how: Any) -> Pull:
        """``ref`` (a string is parsed; ConfigError names a bad one) with ``how`` to pull it.
        ``label``: when ``ref`` was rewritten to reach it, e.g. a layout path under a host
        root."""
        if isinstance(ref, Pull):
            if label is not None or insecure_registries or how:
                raise TypeError("a Pull already says how to pull; pass no options with it")
            return ref
        parsed = parse_ref(ref) if isinstance(ref, str) else ref
        return cls(parsed, label or str(parsed), insecure_registries=tuple(insecure_registries),
                   **how)

    @property
    def retry(self) -> RetryPolicy:
        return RetryPolicy(retries=max(0, self.retries), backoff=self.backoff)

    def source(self) -> Source:
        if isinstance(self.ref, LayoutRef):
            return LayoutSource(self.ref)
        # The registry client pulls in oras, requests and jsonschema (a third of a
        # second): only a pull pays for it, never plan or revert.
        from .remote import RegistrySource  # noqa: PLC0415

        return RegistrySource(self.ref, credentials=self.credentials,
                              insecure_registries=self.insecure_registries,
                              deadlines=self.deadlines)
