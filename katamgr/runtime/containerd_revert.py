"""Taking katamgr's runtimes out of containerd's config again, and telling a watcher whether
someone dropped them (``check_entries``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import tomlkit

from gpunode.host.files import remove_file, write_atomic
from gpunode.host.root import HostRoot
from katamgr.runtime import containerd_state as st
from katamgr.runtime.containerd_files import (
    DROP_IN,
    MAIN,
    ContainerdChange,
    KataRuntime,
    diff,
    read_main,
    target_of,
)
from katamgr.runtime.containerd_imports import read_toml
from katamgr.runtime.containerd_schema import layout_for
from katamgr.runtime.settings import DEFAULT_CONFIG_PATH
from katamgr.runtime.tomledit import add_table, delete, lookup, plain, prune_empty, set_value

log = logging.getLogger(__name__)


def revert_containerd(host: HostRoot, config_path: str = DEFAULT_CONFIG_PATH) -> ContainerdChange:
    """Undo everything ``configure_containerd`` did to this config.

    Untouched since our last write: the original bytes come back exactly (or the file
    goes, if we created it). Edited by someone else since: only our runtimes and the
    values we set are taken out, their edits stay.
    """
    state = st.load(host, config_path)
    if state is None:
        log.info("containerd: nothing of ours recorded for %s", config_path)
        return ContainerdChange(config_path, False, MAIN, 0)
    local = host.path(state.target)
    try:
        current: bytes | None = local.read_bytes()
    except FileNotFoundError:
        current = None
    removed = tuple(state.runtime_names())
    old_text = current.decode() if current is not None else ""
    if state.at_original(current):
        log.info("containerd: %s holds its original content already", state.target)
        changed, new_text = False, old_text
    elif current is None:
        log.warning("containerd: %s is gone already; nothing to revert", state.target)
        changed, new_text = False, ""
    else:
        ours = state.pristine and state.holds_ours(current)
        if ours and state.existed and state.original is not None:
            changed = write_atomic(local, state.original)
            new_text = state.original
        elif (ours and not state.existed) or state.mode == DROP_IN:
            changed = remove_file(local)
            new_text = ""
        else:
            doc = tomlkit.parse(old_text)
            for entry in reversed(state.entries):
                undo(doc, entry)
            prune_empty(doc, [tuple(p) for p in state.created_tables])
            new_text = tomlkit.dumps(doc)
            changed = write_atomic(local, new_text)
    if changed:
        log.info("containerd: reverted %s (removed runtimes %s)", state.target, list(removed))
    st.forget(host, config_path)
    return ContainerdChange(
        state.target,
        changed,
        state.mode,
        state.version,
        diff(state.target, old_text, new_text) if changed else "",
        (),
        (),
        removed,
    )


def undo(doc: tomlkit.TOMLDocument, entry: st.Entry) -> bool:
    """Take one entry of ours out of ``doc``; False when there was nothing left to undo
    (e.g. a write that removed it landed just before a crash)."""
    path = tuple(entry.path)
    current = plain(lookup(doc, path))
    if entry.had_prior and current == entry.prior:
        return False
    if entry.kind == st.VALUE and current != entry.ours:
        log.info("containerd: keeping %s = %r, set by someone else since", ".".join(path), current)
        return False
    if entry.kind == st.RUNTIME:
        removed = delete(doc, path)
        if entry.had_prior and isinstance(entry.prior, dict):
            add_table(doc, path, entry.prior)
            return True
        return removed
    if entry.had_prior:
        return set_value(doc, path, entry.prior)
    return delete(doc, path)


def check_entries(host: HostRoot, path: str, runtimes: Sequence[KataRuntime]) -> list[str]:
    """Names of ``runtimes`` whose entry containerd's config (``path``, the main file,
    following our drop-in if one is in use) no longer holds as we wrote it."""
    main = read_main(host, path, None)
    layout = layout_for(main.version)
    _mode, target = target_of(main)
    doc = main.doc if target == path else read_toml(host.path(target), target)
    missing = []
    for rt in runtimes:
        entry = plain(lookup(doc, layout.runtime_path(rt.name))) if doc is not None else None
        if (
            not isinstance(entry, dict)
            or any(entry.get(k) != v for k, v in rt.entry().items() if k != "options")
            or (entry.get("options") or {}).get("ConfigPath") != rt.config_path
        ):
            missing.append(rt.name)
    return missing
