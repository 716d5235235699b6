"""Kata artifacts (guest kernel, initrd/image, Kata config) from an OCI registry or layout.

Public API: ``Pull`` (what to pull and how), ``resolve_artifact`` -> ``Resolution``,
``install_artifact`` -> ``InstallResult``, ``read_install``, ``remove_install``,
``NotOursError`` (a destination katamgr did not install), ``parse_ref``,
``credentials_from_dockerconfigjson`` -> ``Credentials``, ``ArtifactError``.
"""

from .credentials import Credentials, credentials_from_dockerconfigjson
from .deadlines import DEFAULT_DEADLINES, Deadlines
from .errors import ArtifactError
from .install import InstallResult, Resolution, install_artifact, remove_install, resolve_artifact
from .manifest import DEFAULT_MAX_LAYER_BYTES, MAX_MANIFEST_BYTES
from .pull import Pull
from .record import InstalledFile, InstallRecord, NotOursError, read_install
from .refs import ArtifactRef, LayoutRef, RegistryRef, parse_ref

__all__ = [
    "DEFAULT_DEADLINES",
    "DEFAULT_MAX_LAYER_BYTES",
    "MAX_MANIFEST_BYTES",
    "ArtifactError",
    "ArtifactRef",
    "Credentials",
    "Deadlines",
    "InstallRecord",
    "InstallResult",
    "InstalledFile",
    "LayoutRef",
    "NotOursError",
    "Pull",
    "RegistryRef",
    "Resolution",
    "credentials_from_dockerconfigjson",
    "install_artifact",
    "parse_ref",
    "read_install",
    "remove_install",
    "resolve_artifact",
]
