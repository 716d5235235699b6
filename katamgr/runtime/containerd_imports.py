"""containerd ``imports``: where our drop-in goes and what it must carry.

When the main config imports a glob (``/etc/containerd/conf.d/*.toml``, the default
of containerd 2.x) we write our own file matching it and leave the main file alone.

containerd 1.x merges an imported file by replacing each plugin section it names
as a whole (containerd issue #5837; only 2.0 merges plugin sections key by key). A
version 2 drop-in that names only our runtimes would wipe the operator's CRI
settings on 1.x, so it carries a copy of the CRI plugin section as containerd 1.x
would otherwise see it. Version 3+ drop-ins hold only our entries.
"""

from __future__ import annotations

import fnmatch
import glob
import posixpath
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomlkit
from tomlkit.exceptions import TOMLKitError

from gpunode.errors import ConfigError
from gpunode.host.root import HostRoot
from katamgr.runtime.tomledit import lookup, plain

DROP_IN_NAME = "kata-sandbox-manager.toml"
_GLOB_CHARS = "*?["


def _import_entries(doc: Mapping[str, Any], main_host_path: str) -> list[str]:
    raw = plain(doc.get("imports")) or []
    if not isinstance(raw, list):
        raise ConfigError(f"{main_host_path} has imports = {raw!r}; expected a list of paths")
    # containerd 1.6 resolves a relative import against its working directory, not
    # the config's: we cannot know where that points, so only absolute ones count.
    return [p for p in raw if isinstance(p, str) and posixpath.isabs(p)]


def find_drop_in(doc: Mapping[str, Any], main_host_path: str) -> str | None:
    """Host path of our drop-in when an import glob would pick it up, else None."""
    for pattern in _import_entries(doc, main_host_path):
        directory, name = posixpath.split(pattern)
        if not any(c in name for c in _GLOB_CHARS) or any(c in directory for c in _GLOB_CHARS):
            continue
        if fnmatch.fnmatchcase(DROP_IN_NAME, name):
            return posixpath.join(directory, DROP_IN_NAME)
    return None


def read_toml(local: Path, host_path: str) -> tomlkit.TOMLDocument | None:
    try:
        text = local.read_text()
    except FileNotFoundError:
        return None
    try:
        return tomlkit.parse(text)
    except TOMLKitError as exc:
        raise ConfigError(f"{host_path} is not valid TOML ({exc}); fix or remove it") from exc


def effective_plugin_section(
    host: HostRoot,
    main_doc: Mapping[str, Any],
    main_host_path: str,
    plugin_path: tuple[str, ...],
    skip: str,
) -> dict[str, Any] | None:
    """The plugin section containerd 1.x ends up with: the last file (main, then
    imports in order, each glob sorted) that names it wins whole."""
    section = plain(lookup(main_doc, plugin_path))
    for pattern in _import_entries(main_doc, main_host_path):
        for local in sorted(glob.glob(str(host.path(pattern)))):
            host_path = host.host_path(Path(local))
            if host_path == skip:
                continue
            doc = read_toml(Path(local), host_path)
            found = plain(lookup(doc, plugin_path)) if doc is not None else None
            if found is not None:
                section = found
    return section if isinstance(section, dict) else None
