"""Register Kata runtime classes with containerd, and take them out again.

``configure_containerd`` makes the config hold exactly the given Kata runtimes (plus
CDI enabled) and nothing else of ours; ``containerd_revert.revert_containerd`` undoes all
of it; ``containerd_revert.check_entries`` tells a watcher whether someone dropped our entries.

Files are edited with tomlkit, so comments, order and every unrelated value stay as
they were; a file whose content would not change is never rewritten (and needs no
containerd restart). A missing config file is started afresh as version 2 (read by
containerd 1.x and 2.x alike) unless the caller forces another version; an existing
file without ``version`` is refused (see ``containerd_schema.detect_version``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import tomlkit

from gpunode.errors import ConfigError
from gpunode.host.files import write_atomic
from gpunode.host.root import HostRoot
from gpunode.k8snames import DNS1123_LABEL_MAX, is_dns1123_label
from katamgr.runtime import containerd_state as st
from katamgr.runtime.containerd_files import (
    DROP_IN,
    MAIN,
    ContainerdChange,
    KataRuntime,
    Main,
    diff,
    read_main,
    target_of,
    tidy,
)
from katamgr.runtime.containerd_imports import (
    effective_plugin_section,
    read_toml,
)

# check_entries: importers from before containerd_revert still find it here.
from katamgr.runtime.containerd_revert import check_entries, revert_containerd, undo  # noqa: F401
from katamgr.runtime.containerd_schema import (
    CDI_SPEC_DIRS,
    Layout,
    layout_for,
)
from katamgr.runtime.settings import DEFAULT_CONFIG_PATH
from katamgr.runtime.tomledit import (
    add_table,
    lookup,
    plain,
    set_value,
    to_item,
)

log = logging.getLogger(__name__)


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
    main = read_main(host, config_path, version)
    mode, target = target_of(main)
    state = st.load(host, config_path)
    if state is not None and (state.target != target or state.mode != mode) and dry_run:
        state = None
    elif state is not None and (state.target != target or state.mode != mode):
        log.info(
            "containerd: our entries move from %s to %s; undoing the old ones", state.target, target
        )
        revert_containerd(host, config_path)
        main = read_main(host, config_path, version)
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


def _apply(host: HostRoot, main: Main, edit: _Edit, dry_run: bool) -> ContainerdChange:
    """One apply over either target: the change for the report, then (unless ``dry_run``)
    the durable write, or the state settled where nothing changed."""
    change = ContainerdChange(
        edit.target, edit.changed, edit.mode, main.version,
        diff(edit.target, edit.old_text, edit.new_text) if edit.changed else "",
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
    main: Main,
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
        new_text = tidy(new_text)
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
        if undo(doc, entry):
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


def _edit_drop_in(
    host: HostRoot,
    main: Main,
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
    new_text = tidy(tomlkit.dumps(doc))
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


