"""The error every artifact failure raises (a bad ref or pull secret is a ConfigError)."""

from __future__ import annotations

from katamgr.errors import KatamgrError


class ArtifactError(KatamgrError):
    """Pulling or installing an artifact failed; the previous install, if any, is untouched."""
