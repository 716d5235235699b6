"""The error every artifact failure raises (a bad ref or pull secret is a ConfigError)."""

from __future__ import annotations

from gpunode.errors import GpuNodeError


class ArtifactError(GpuNodeError):
    """Pulling or installing an artifact failed; the previous install, if any, is untouched."""
