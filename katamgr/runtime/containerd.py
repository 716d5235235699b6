"""Register Kata runtime classes with containerd, and take them out again.

``configure_containerd`` makes the config hold exactly the given Kata runtimes (plus
CDI enabled) and nothing else of ours; ``revert_containerd`` undoes all of it;
``check_entries`` tells a watcher whether someone dropped our entries.

Files are edited with tomlkit, so comments, order and every unrelated value stay as
they were; a file whose content would not change is never rewritten (and needs no
containerd restart). A missing config file is started afresh as version 2 (read by
containerd 1.x and 2.x alike) unless the caller forces another version; an existing
file without ``version`` is refused (see ``containerd_schema.detect_version``).
"""

from __future__ import annotations

import copy
import difflib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import tomlkit

from katamgr.errors import ConfigError
from katamgr.host.files import remove_file, write_atomic
from katamgr.host.root import HostRoot
from katamgr.k8snames import DNS1123_LABEL_MAX, is_dns1123_label
from katamgr.runtime import containerd_state as st
from katamgr.runtime.containerd_imports import (
    effective_plugin_section,
    find_drop_in,
    read_toml,
)
from katamgr.runtime.containerd_schema import (
    CDI_SPEC_DIRS,
    KATA_RUNTIME_TYPE,
    Layout,
    detect_version,
    layout_for,
)
from katamgr.runtime.settings import DEFAULT_CONFIG_PATH, DEFAULT_POD_ANNOTATIONS
from katamgr.runtime.tomledit import (
    add_table,
    delete,
    lookup,
    plain,
    prune_empty,
    set_value,
    to_item,
)

log = logging.getLogger(__name__)

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


@dataclass
class _Outcome:
    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


def _validate(runtimes: Sequence[KataRuntime]) -> None:
    seen: set[str] = set()
    for rt in runtimes:
        if not is_dns1123_label(rt.name):
            raise ConfigError(
                f"runtime class name {rt.name!r} is not a valid RuntimeClass handler; use "
                f"lowercase letters, digits and '-' (at most {DNS1123_LABEL_MAX} characters)"
            )
        if rt.name in seen:
            raise ConfigError(f"runtime class {rt.name!r} is listed twice; list it once")
        seen.add(rt.name)
        if not rt.config_path.startswith("/"):
            raise ConfigError(
                f"Kata config path {rt.config_path!r} of runtime class {rt.name!r} is not "
                f"absolute; give the path as the host sees it"
            )


def _is_blank(text: str) -> bool:
    return all(not line.strip() or line.lstrip().startswith("#") for line in text.splitlines())


def _tidy(text: str) -> str:
    """Blank-line hygiene for files we generate whole (never for the operator's file)."""
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n") + "\n"


def _diff(path: str, old: str, new: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), path, path))


@dataclass(frozen=True)
class _Main:
    path: str
    data: bytes | None
    doc: tomlkit.TOMLDocument
    version: int
    fresh: bool  # missing or holding nothing but comments: we may start it


def _read_main(host: HostRoot, config_path: str, version: int | None) -> _Main:
    local = host.path(config_path)
    try:
        data: bytes | None = local.read_bytes()
    except FileNotFoundError:
        data = None
    text = data.decode() if data is not None else ""
    doc = read_toml(local, config_path) if data is not None else tomlkit.document()
    assert doc is not None
    if _is_blank(text):
        chosen = version if version is not None else NEW_FILE_VERSION
        layout_for(chosen)
        return _Main(config_path, data, doc, chosen, True)
    return _Main(config_path, data, doc, detect_version(doc, config_path, version), False)


def _target(main: _Main) -> tuple[str, str]:
    drop_in = None if main.fresh else find_drop_in(main.doc, main.path)
    return (DROP_IN, drop_in) if drop_in else (MAIN, main.path)


def configure_containerd(
    host: HostRoot,
    runtimes: Sequence[KataRuntime],
    config_path: str = DEFAULT_CONFIG_PATH,
    version: int | None = None,
    enable_cdi: bool = True,
    dry_run: bool = False,
) -> ContainerdChange:
    """Make containerd's config hold exactly ``runtimes`` of ours (and CDI enabled).

    Runtimes we added earlier and that are no longer listed are taken out again.
    ``version`` forces the config version for a new file and must match an existing one.
    ``dry_run`` computes the change (and its diff) without writing anything.
    """
    _validate(runtimes)
    main = _read_main(host, config_path, version)
    mode, target = _target(main)
    state = st.load(host, config_path)
    if state is not None and (state.target != target or state.mode != mode) and dry_run:
        state = None
    elif state is not None and (state.target != target or state.mode != mode):
        log.info(
            "containerd: our entries move from %s to %s; undoing the old ones", state.target, target
        )
        revert_containerd(host, config_path)
        main = _read_main(host, config_path, version)
        state = None
    if mode == DROP_IN:
        edit = _edit_drop_in(host, main, target, runtimes, enable_cdi, state, dry_run)
    else:
        edit = _edit_main(host, main, runtimes, enable_cdi, state, dry_run)
    return _apply(host, main, edit, dry_run)


def _resume(
    host: HostRoot,
    config_path: str,
    state: st.EditState | None,
    current: bytes | None,
    dry_run: bool,
) -> st.EditState | None:
    """The recorded state, unless the target is back to its original bytes (our first
    write never landed, or a revert was cut short): then nothing of ours is in it and
    we start afresh."""
    if state is None or not state.at_original(current):
        return state
    log.info("containerd: %s holds its original content; starting afresh", state.target)
    if not dry_run:
        st.forget(host, config_path)
    return None


def _write_durably(
    host: HostRoot,
    config_path: str,
    state: st.EditState,
    pending: list[st.Entry],
    current: bytes | None,
    new_text: str,
) -> None:
    """Write ``new_text`` to the target so that a crash at any point leaves a state
    that revert (and the next configure) can work from.

    Before the write the state records the original, the hashes on both sides of the
    write and ``pending`` (every entry of ours the file may hold before or after it);
    only once the write has landed does it shrink to ``state.entries``.
    """
    final = state.entries
    new = new_text.encode()
    state.entries = pending
    state.begin_write(current, new)
    st.save(host, config_path, state)
    write_atomic(host.path(state.target), new)
    state.entries = final
    state.settle(new)
    st.save(host, config_path, state)


@dataclass
class _Edit:
    """What one apply makes of its target file, worked out before anything is written:
    the main config edited in place, or our drop-in written whole."""

    target: str  # host path of the file: the main config or our drop-in
    mode: str
    old: bytes | None  # the file's content now (None: missing)
    new_text: str
    outcome: _Outcome
    state: st.EditState  # what is recorded once the write has landed
    pending: list[st.Entry]  # every entry of ours the file may hold before or after the write
    # With nothing to write: record the state anyway (it was known before, or the file is
    # already exactly what we would write and so ours to remove on revert).
    keep_unchanged: bool

    @property
    def old_text(self) -> str:
        return self.old.decode() if self.old is not None else ""

    @property
    def changed(self) -> bool:
        return self.new_text != self.old_text


def _apply(host: HostRoot, main: _Main, edit: _Edit, dry_run: bool) -> ContainerdChange:
    """One apply over either target: the change for the report, then (unless ``dry_run``)
    the durable write, or the state settled where nothing changed."""
    change = ContainerdChange(
        edit.target, edit.changed, edit.mode, main.version,
        _diff(edit.target, edit.old_text, edit.new_text) if edit.changed else "",
        tuple(edit.outcome.added), tuple(edit.outcome.updated), tuple(edit.outcome.removed),
    )
    if dry_run:
        return change
    if edit.changed:
        _write_durably(host, main.path, edit.state, edit.pending, edit.old, edit.new_text)
        log.info("containerd: %s %s written (added %s, updated %s, removed %s)",
                 "our drop-in" if edit.mode == DROP_IN else "config", edit.target,
                 edit.outcome.added or "-", edit.outcome.updated or "-", edit.outcome.removed or "-")
    elif edit.keep_unchanged:
        edit.state.settle(edit.old)
        st.save(host, main.path, edit.state)
    return change


def _edit_main(
    host: HostRoot,
    main: _Main,
    runtimes: Sequence[KataRuntime],
    enable_cdi: bool,
    state: st.EditState | None,
    dry_run: bool,
) -> _Edit:
    """The operator's config, edited in place: our entries recorded one by one, with what
    each replaced, so that a revert restores every other byte."""
    layout = layout_for(main.version)
    old_text = main.data.decode() if main.data is not None else ""
    doc = main.doc
    state = _resume(host, main.path, state, main.data, dry_run)
    had_state = state is not None
    if state is None:
        original = old_text if main.data is not None else None
        state = st.EditState(
            main.path, MAIN, main.version, existed=main.data is not None, original=original
        )
    elif not state.holds_ours(main.data):
        # Someone else wrote the file after us: from now on only a surgical revert is safe.
        state.pristine = False
    if main.fresh and "version" not in doc:
        doc.add("version", main.version)
    before = list(state.entries)
    outcome = _edit(doc, layout, runtimes, enable_cdi, state)
    new_text = tomlkit.dumps(doc)
    if main.fresh:
        new_text = _tidy(new_text)
    # Entries we drop stay recorded until the write lands: the file holds them till then.
    pending = before + [e for e in state.entries if not any(e is b for b in before)]
    return _Edit(main.path, MAIN, main.data, new_text, outcome, state, pending, had_state)


def _edit(
    doc: tomlkit.TOMLDocument,
    layout: Layout,
    runtimes: Sequence[KataRuntime],
    enable_cdi: bool,
    state: st.EditState,
) -> _Outcome:
    outcome = _Outcome()
    wanted = {rt.name for rt in runtimes}
    for entry in [e for e in state.entries if e.kind == st.RUNTIME and e.path[-1] not in wanted]:
        state.entries.remove(entry)
        if _undo(doc, entry):
            outcome.removed.append(entry.path[-1])
    for rt in runtimes:
        path = layout.runtime_path(rt.name)
        current = lookup(doc, path)
        if state.entry(path) is None:
            state.entries.append(
                st.Entry(
                    list(path),
                    st.RUNTIME,
                    rt.entry(),
                    current is not None,
                    copy.deepcopy(plain(current)),
                )
            )
        else:
            state.entry(path).ours = rt.entry()
        if current is None:
            _note_created(state, add_table(doc, path, rt.entry()))
            outcome.added.append(rt.name)
        elif _set_entry(doc, path, rt.entry()):
            outcome.updated.append(rt.name)
    if enable_cdi:
        dirs = plain(lookup(doc, layout.cdi_spec_dirs_path))
        dirs = list(dirs) if isinstance(dirs, list) else []
        dirs += [d for d in CDI_SPEC_DIRS if d not in dirs]
        for path, value in ((layout.enable_cdi_path, True), (layout.cdi_spec_dirs_path, dirs)):
            if state.entry(path) is None:
                current = lookup(doc, path)
                state.entries.append(
                    st.Entry(list(path), st.VALUE, value, current is not None, plain(current))
                )
            else:
                state.entry(path).ours = value
            set_value(doc, path, value)
    return outcome


def _note_created(state: st.EditState, created: list[tuple[str, ...]]) -> None:
    for path in created:
        if list(path) not in state.created_tables:
            state.created_tables.append(list(path))


def _set_entry(doc: tomlkit.TOMLDocument, path: tuple[str, ...], content: dict[str, Any]) -> bool:
    changed = False
    for key, value in content.items():
        if isinstance(value, dict):
            changed |= _set_entry(doc, (*path, key), value)
        else:
            changed |= set_value(doc, (*path, key), value)
    return changed


def _undo(doc: tomlkit.TOMLDocument, entry: st.Entry) -> bool:
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


def _edit_drop_in(
    host: HostRoot,
    main: _Main,
    target: str,
    runtimes: Sequence[KataRuntime],
    enable_cdi: bool,
    state: st.EditState | None,
    dry_run: bool,
) -> _Edit:
    """Our drop-in, written whole from the runtimes (and, for containerd 1.x, the CRI plugin
    settings it must repeat): the main config is never touched."""
    layout = layout_for(main.version)
    local = host.path(target)
    try:
        old: bytes | None = local.read_bytes()
    except FileNotFoundError:
        old = None
    old_text = old.decode() if old is not None else ""
    doc = tomlkit.document()
    doc.add(tomlkit.comment(f"Written by kata-sandbox-manager for {main.path}; removed on revert."))
    if layout.version == 2:
        doc.add(
            tomlkit.comment("containerd 1.x replaces a whole plugin section per imported file,")
        )
        doc.add(tomlkit.comment("so this file repeats the CRI plugin settings it found elsewhere."))
    doc.add("version", main.version)
    if layout.version == 2:
        section = effective_plugin_section(host, main.doc, main.path, layout.plugin_path, target)
        if section:
            for key in layout.plugin_path[:-1]:
                doc.add(key, tomlkit.table(is_super_table=True))
            doc["plugins"][layout.plugin] = to_item(section)
    state = _resume(host, main.path, state, old, dry_run)
    fresh_state = st.EditState(
        target,
        DROP_IN,
        main.version,
        existed=old is not None,
        original=old_text if old is not None else None,
    )
    outcome = _edit(doc, layout, runtimes, enable_cdi, fresh_state)
    previous = read_toml(local, target) if old is not None else None
    outcome.added, outcome.updated = [], []
    for rt in runtimes:
        before = plain(lookup(previous, layout.runtime_path(rt.name))) if previous else None
        if before is None:
            outcome.added.append(rt.name)
        elif before != plain(lookup(doc, layout.runtime_path(rt.name))):
            outcome.updated.append(rt.name)
    if state is not None and previous is not None:
        wanted = {rt.name for rt in runtimes}
        outcome.removed = [n for n in state.runtime_names() if n not in wanted]
    new_text = _tidy(tomlkit.dumps(doc))
    pending = fresh_state.entries + (
        [e for e in state.entries if fresh_state.entry(e.path) is None] if state else [])
    if state is None:
        state = fresh_state
        if new_text == old_text:
            # The file already holds exactly what we write: it is ours to remove on revert.
            state.existed, state.original = False, None
    else:
        if not state.holds_ours(old):
            state.pristine = False
        state.entries = fresh_state.entries
    return _Edit(target, DROP_IN, old, new_text, outcome, state, pending, True)


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
                _undo(doc, entry)
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
        _diff(state.target, old_text, new_text) if changed else "",
        (),
        (),
        removed,
    )


def check_entries(host: HostRoot, path: str, runtimes: Sequence[KataRuntime]) -> list[str]:
    """Names of ``runtimes`` whose entry containerd's config (``path``, the main file,
    following our drop-in if one is in use) no longer holds as we wrote it."""
    main = _read_main(host, path, None)
    layout = layout_for(main.version)
    _mode, target = _target(main)
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
