"""Artifact references: a registry ref (``host/repo:tag``, ``host/repo@sha256:...``) or an
OCI image layout on disk (``oci-layout://PATH[:TAG]``, ``oci-layout://PATH@sha256:...``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gpunode.errors import ConfigError

LAYOUT_SCHEME = "oci-layout://"
DEFAULT_TAG = "latest"

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_PATH_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_HOST = re.compile(
    r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*)(?::[0-9]{1,5})?"
)

# What parse_ref accepts (and, for a layout, the config's absolute-path rule short of '/' and
# '..', which the chart checks apart), as one regular expression that means the same to
# Python's re and to Go's RE2 (no lookaround): the chart refuses at render time, with
# regexMatch, an artifacts.url this does not match (templates/_validate.tpl,
# ksm.validateArtifactRefs, holds a copy; tests/chart/test_artifact_refs.py holds them equal
# and checks both on a table of references).
_SPACE = r"[ \t\n\r\f\v]*"  # parse_ref strips the text first
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_PORT = r":[0-9]{1,5}"
_REGISTRY_HOST = (rf"(?:\[[0-9A-Fa-f:.]+\](?:{_PORT})?|{_LABEL}(?:\.{_LABEL})*{_PORT}"
                  rf"|{_LABEL}(?:\.{_LABEL})+|localhost)")
_COMPONENT = _PATH_COMPONENT.pattern
_REGISTRY_REF = (rf"{_REGISTRY_HOST}/{_COMPONENT}(?:/{_COMPONENT})*(?::{_TAG.pattern})?"
                 rf"(?:@{_DIGEST.pattern})?")
_LAYOUT_REF = (rf"oci-layout://(?:/[^\x00]*@{_DIGEST.pattern}"
               rf"|(?:/[^@\x00]*)?/(?:[^@\x00:/]*|[^@\x00/]*:{_TAG.pattern}))")
REFERENCE_PATTERN = rf"^{_SPACE}(?:{_REGISTRY_REF}|{_LAYOUT_REF}){_SPACE}$"


@dataclass(frozen=True)
class RegistryRef:
    registry: str  # host[:port], e.g. "nvcr.io" or "127.0.0.1:5000"
    repository: str  # e.g. "nvidia/cloud-native/kata-gpu-artifacts"
    tag: str | None
    digest: str | None  # "sha256:<64 hex>"; wins over the tag when both are given

    @property
    def reference(self) -> str:
        """What goes after ``/manifests/`` in the registry API."""
        return self.digest or self.tag or DEFAULT_TAG

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repository}"
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text


@dataclass(frozen=True)
class LayoutRef:
    path: Path  # the layout dir (holds oci-layout, index.json, blobs/)
    tag: str | None  # matched against org.opencontainers.image.ref.name
    digest: str | None

    def __str__(self) -> str:
        text = f"{LAYOUT_SCHEME}{self.path}"
        if self.digest:
            return f"{text}@{self.digest}"
        return f"{text}:{self.tag}" if self.tag else text


ArtifactRef = RegistryRef | LayoutRef


def is_digest(text: str) -> bool:
    return _DIGEST.fullmatch(text) is not None


def check_digest(digest: str, ref: str) -> str:
    if not is_digest(digest):
        raise ConfigError(
            f"artifact ref {ref!r} has digest {digest!r}, which is not 'sha256:' and 64 lower-case"
            " hex digits; copy the digest exactly as the registry shows it"
        )
    return digest


def parse_ref(text: str) -> ArtifactRef:
    """Parse an artifact ref; raise ConfigError naming the bad value."""
    text = text.strip() if isinstance(text, str) else text
    if not isinstance(text, str) or not text:
        raise ConfigError(
            f"artifact ref {text!r} is empty; give host/repo:tag, host/repo@sha256:... or "
            "oci-layout://PATH:TAG"
        )
    if text.startswith(LAYOUT_SCHEME):
        return _parse_layout(text)
    if "://" in text:
        raise ConfigError(
            f"artifact ref {text!r} has a URL scheme; drop it (write host/repo:tag) or use "
            "oci-layout://PATH for a layout on disk"
        )
    return _parse_registry(text)


def _parse_layout(text: str) -> LayoutRef:
    rest = text[len(LAYOUT_SCHEME) :]
    tag = digest = None
    if "@" in rest:
        rest, digest = rest.rsplit("@", 1)
        check_digest(digest, text)
    else:
        head, sep, tail = rest.rpartition(":")
        if sep and "/" not in tail:
            if not _TAG.fullmatch(tail):
                raise ConfigError(
                    f"artifact ref {text!r} has tag {tail!r}, which is not a valid tag "
                    "(letters, digits, '_', '.', '-'; at most 128)"
                )
            rest, tag = head, tail
    if not rest:
        raise ConfigError(
            f"artifact ref {text!r} names no layout dir; write oci-layout:///path/to/layout:TAG"
        )
    return LayoutRef(Path(rest), tag, digest)


def _parse_registry(text: str) -> RegistryRef:
    name, digest = text, None
    if "@" in name:
        name, digest = name.split("@", 1)
        check_digest(digest, text)
    host, slash, path = name.partition("/")
    if not slash or not path:
        raise ConfigError(
            f"artifact ref {text!r} has no registry host; write it in full, "
            "e.g. nvcr.io/nvidia/kata-artifacts:TAG"
        )
    if not _HOST.fullmatch(host) or not ("." in host or ":" in host or host == "localhost"):
        raise ConfigError(
            f"artifact ref {text!r} starts with {host!r}, which is not a registry host "
            "(a host name with a dot or a port, or localhost); write it in full, "
            "e.g. nvcr.io/nvidia/kata-artifacts:TAG"
        )
    tag = None
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, tag = path.rsplit(":", 1)
        if not _TAG.fullmatch(tag):
            raise ConfigError(
                f"artifact ref {text!r} has tag {tag!r}, which is not a valid tag "
                "(letters, digits, '_', '.', '-'; at most 128)"
            )
    for component in path.split("/"):
        if not _PATH_COMPONENT.fullmatch(component):
            raise ConfigError(
                f"artifact ref {text!r} has repository part {component!r}, which is not valid "
                "(lower-case letters and digits, separated by '.', '_' or '-')"
            )
    if tag is None and digest is None:
        tag = DEFAULT_TAG
    return RegistryRef(host, path, tag, digest)
