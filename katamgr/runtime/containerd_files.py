"""containerd's config as katamgr finds it: the Kata runtime entry, the main file read with
its version, where our entries go (the main file or our drop-in), and the change reported.

Shared by the edit (``katamgr.runtime.containerd``) and its undo and check
(``katamgr.runtime.containerd_revert``).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any

import tomlkit

from gpunode.host.root import HostRoot
from katamgr.runtime.containerd_imports import find_drop_in, read_toml
from katamgr.runtime.containerd_schema import KATA_RUNTIME_TYPE, detect_version, layout_for
from katamgr.runtime.settings import DEFAULT_POD_ANNOTATIONS

NEW_FILE_VERSION = 2
MAIN, DROP_IN = "main", "drop-in"



@dataclass(frozen=True)
class KataRuntime:
    """One runtime class as containerd sees it (the RuntimeClass handler)."""

    name: str
    config_path: str  # host path of the Kata configuration-*.toml
    pod_annotations: tuple[str, ...] = DEFAULT_POD_ANNOTATIONS

    def entry(self) -> dict[str, Any]:
        return {
            "runtime_type": KATA_RUNTIME_TYPE,
            "privileged_without_host_devices": True,
            "pod_annotations": list(self.pod_annotations),
            "options": {"ConfigPath": self.config_path},
        }


@dataclass(frozen=True)
class ContainerdChange:
    path: str  # host path of the file written (the main config or our drop-in)
    changed: bool
    mode: str  # "main" or "drop-in"
    version: int
    diff: str = ""
    runtimes_added: tuple[str, ...] = ()
    runtimes_updated: tuple[str, ...] = ()
    runtimes_removed: tuple[str, ...] = ()

    @property
    def needs_reload(self) -> bool:
        """containerd only sees new runtimes after a restart; only a real change needs one."""
        return self.changed


def is_blank(text: str) -> bool:
    return all(not line.strip() or line.lstrip().startswith("#") for line in text.splitlines())


def tidy(text: str) -> str:
    """Blank-line hygiene for files we generate whole (never for the operator's file)."""
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n") + "\n"


def diff(path: str, old: str, new: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), path, path))


@dataclass(frozen=True)
class Main:
    path: str
    data: bytes | None
    doc: tomlkit.TOMLDocument
    version: int
    fresh: bool  # missing or holding nothing but comments: we may start it


def read_main(host: HostRoot, config_path: str, version: int | None) -> Main:
    local = host.path(config_path)
    try:
        data: bytes | None = local.read_bytes()
    except FileNotFoundError:
        data = None
    text = data.decode() if data is not None else ""
    doc = read_toml(local, config_path) if data is not None else tomlkit.document()
    assert doc is not None
    if is_blank(text):
        chosen = version if version is not None else NEW_FILE_VERSION
        layout_for(chosen)
        return Main(config_path, data, doc, chosen, True)
    return Main(config_path, data, doc, detect_version(doc, config_path, version), False)


def target_of(main: Main) -> tuple[str, str]:
    drop_in = None if main.fresh else find_drop_in(main.doc, main.path)
    return (DROP_IN, drop_in) if drop_in else (MAIN, main.path)
