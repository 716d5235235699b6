"""The CDI names an Allocate answer may carry: only names the host's specs resolve.

On kubelet >= 1.29 the ``cdi_devices`` of an Allocate answer reach the runtime,
and containerd fails the pod when a name is not defined in ``/etc/cdi`` or
``/var/run/cdi``. Worse, a name defined by a spec written before the devices
changed may point at another device. So the plugin never invents a name: it
reads the specs actually on the host and hands out a name only when the spec
entry behind it injects exactly the allocated device.

``HostCdiSpecs`` keeps the loaded specs and reloads them only when a spec file
appears, disappears or changes (name, size, mtime, inode). Whether to look at
the files at all is told by inotify on the spec directories, which costs one
syscall per Allocate when nothing happened there (a directory listing and a
stat per spec file when inotify cannot be had).
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from inotify_simple import INotify
from inotify_simple import flags as inotify_flags

import cdi
from gpunode.host.root import HostRoot
from gpunode.policy.passthrough import PassthroughDevice

log = logging.getLogger(__name__)

# The container-wide nodes of a VFIO spec (the container and iommufd); every
# device needs one, so they never tell which device an entry injects.
SHARED_NODES = frozenset({"/dev/vfio/vfio", "/dev/iommu"})

_FileKey = tuple[str, int, int, int]  # path, size, mtime_ns, inode


@dataclass(frozen=True)
class _Loaded:
    registry: cdi.SpecRegistry
    # (kind, the device's own host nodes) -> qualified names injecting exactly those, spec order
    by_nodes: dict[tuple[str, frozenset[str]], tuple[str, ...]]
    # kind -> host paths of the spec files defining it
    files: dict[str, tuple[str, ...]]


_SPEC_DIR_EVENTS = (
    inotify_flags.CREATE | inotify_flags.DELETE | inotify_flags.MOVED_FROM | inotify_flags.MOVED_TO
    | inotify_flags.CLOSE_WRITE | inotify_flags.MODIFY | inotify_flags.ATTRIB
    | inotify_flags.DELETE_SELF | inotify_flags.MOVE_SELF
)


class _DirChanges:
    """Whether anything happened in some directories since the last ask, in one syscall.

    A directory that does not exist yet is stood in for by its nearest existing
    ancestor (below ``top``) until it appears. inotify events come in the
    syscall that makes the change, so a spec written before an Allocate is seen
    by that Allocate.
    """

    def __init__(self, dirs: tuple[str, ...], top: str) -> None:
        self._dirs = dirs
        self._top = top
        self._inotify = INotify(nonblocking=True)
        # poll(0) asks in one syscall with no Python objects made: the Allocate path.
        self._poll = select.poll()
        self._poll.register(self._inotify.fileno(), select.POLLIN)
        self._watched: dict[int, str] = {}
        try:
            self._watch()
        except OSError:
            self._inotify.close()
            raise

    def _watch(self) -> None:
        present = set(self._watched.values())
        for directory in self._dirs:
            path = directory
            while not os.path.isdir(path) and len(path) > len(self._top):
                path = os.path.dirname(path)
            if path not in present:
                self._watched[self._inotify.add_watch(path, _SPEC_DIR_EVENTS)] = path
                present.add(path)

    def changed(self) -> bool:
        if not self._poll.poll(0):
            return False
        events = self._inotify.read(timeout=0)
        if not events:
            return False
        for event in events:
            if event.mask & inotify_flags.IGNORED:  # the directory went away
                self._watched.pop(event.wd, None)
        self._watch()  # a spec directory may have just been created
        return True

    def close(self) -> None:
        self._inotify.close()


class _AlwaysChanged:
    """Without inotify: look at the files every time."""

    def changed(self) -> bool:
        return True

    def close(self) -> None:
        pass


class HostCdiSpecs:
    """The CDI specs in the host's spec directories, reloaded when one changes."""

    def __init__(self, host: HostRoot, dirs: Iterable[str] | None = None) -> None:
        self.host = host
        # Resolved on first use: naming cdi.DEFAULT_SPEC_DIRS loads the spec model and
        # PyYAML, which the plugin needs at its first Allocate, not before it registers.
        self._dirs = None if dirs is None else tuple(dirs)
        self._lock = threading.Lock()
        self._fingerprint: tuple[_FileKey, ...] | None = None
        self._loaded: _Loaded | None = None
        self._changes: _DirChanges | _AlwaysChanged | None = None  # opened on first use
        # What was already warned about since the specs last changed.
        self._warned: set[str] = set()

    @property
    def dirs(self) -> tuple[str, ...]:
        if self._dirs is None:
            self._dirs = tuple(cdi.DEFAULT_SPEC_DIRS)
        return self._dirs

    @property
    def _local_dirs(self) -> tuple[str, ...]:
        return tuple(str(self.host.path(d)) for d in self.dirs)

    # -- loading --------------------------------------------------------------

    def _scan(self) -> tuple[_FileKey, ...]:
        keys: list[_FileKey] = []
        for directory in self._local_dirs:
            try:
                entries = list(os.scandir(directory))
            except OSError:
                continue  # missing or unreadable: load_specs records why
            for entry in entries:
                if entry.name.rpartition(".")[2] not in cdi.FORMATS:
                    continue
                try:
                    st = entry.stat()
                except OSError:
                    continue  # removed meanwhile
                keys.append((entry.path, st.st_size, st.st_mtime_ns, st.st_ino))
        return tuple(sorted(keys))

    def current(self) -> _Loaded:
        """The specs as they are now (the same object while no spec file changed)."""
        with self._lock:
            if self._changes is None:
                # Watching starts before the first look, so no change falls between.
                self._changes = self._watch_dirs()
            elif self._loaded is not None and not self._changes.changed():
                return self._loaded
            fingerprint = self._scan()
            if self._loaded is None or fingerprint != self._fingerprint:
                self._loaded = self._load()
                self._fingerprint = fingerprint
                self._warned.clear()
            return self._loaded

    def _watch_dirs(self) -> _DirChanges | _AlwaysChanged:
        try:
            return _DirChanges(self._local_dirs, str(self.host.root))
        except OSError as exc:  # out of inotify instances or watches
            log.info("cannot watch the CDI spec directories (%s); reading them on every Allocate", exc)
            return _AlwaysChanged()

    def close(self) -> None:
        with self._lock:
            if self._changes is not None:
                self._changes.close()
            self._changes = _AlwaysChanged()

    def _load(self) -> _Loaded:
        registry = cdi.load_specs(self._local_dirs)
        by_nodes: dict[tuple[str, frozenset[str]], list[str]] = {}
        files: dict[str, list[str]] = {}
        for loaded in registry.specs:
            files.setdefault(loaded.spec.kind, []).append(self._host_path(loaded.path))
        for name, resolved in registry.devices.items():
            spec = resolved.spec
            # Nodes the spec adds to every device of its kind would go with this one too.
            if set(self._host_nodes(spec.container_edits)) - SHARED_NODES:
                continue
            own = frozenset(self._host_nodes(resolved.device.container_edits)) - SHARED_NODES
            if own:
                by_nodes.setdefault((spec.kind, own), []).append(name)
        log.debug("loaded %d CDI device name(s) from %s", len(registry.devices),
                  ", ".join(self.dirs))
        return _Loaded(registry, {k: tuple(v) for k, v in by_nodes.items()},
                       {k: tuple(v) for k, v in files.items()})

    def _host_nodes(self, edits: cdi.ContainerEdits) -> list[str]:
        """The host device nodes ``edits`` inject (``hostPath`` when set, else ``path``),
        as this root's host names them (``HostRoot.host_node``)."""
        return [self.host.host_node(n.host_path or n.path) for n in edits.device_nodes]

    def _host_path(self, local: os.PathLike[str] | str) -> str:
        try:
            return self.host.host_path(local)
        except ValueError:
            return str(local)

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning(message, *args)

    # -- lookups --------------------------------------------------------------

    def passthrough_names(self, members: Iterable[PassthroughDevice], specs: _Loaded | None = None) -> list[str]:
        """For each member, the qualified name whose spec entry injects exactly its own node(s).

        The canonical index name is preferred; any other name for the same
        node(s) will do (the spec may predate a change of indices). A member no
        entry matches gets no name (and one warning). Repeats are dropped: two
        GPUs of one group can share a name when the spec is stale.
        """
        loaded = specs or self.current()
        names = (self._passthrough_name(loaded, m) for m in members)
        return list(dict.fromkeys(n for n in names if n is not None))

    def _passthrough_name(self, loaded: _Loaded, member: PassthroughDevice) -> str | None:
        own = frozenset(member.nodes) - SHARED_NODES
        names = loaded.by_nodes.get((member.kind, own), ())
        if member.qualified_name in names:
            return member.qualified_name
        if names:
            return names[0]
        files = loaded.files.get(member.kind)
        if files:
            where = f"the spec {', '.join(files)} defines no {member.kind} device with exactly"
        else:
            where = (f"no {member.kind} spec is on the host (katamgr writes "
                     f"{cdi.DYNAMIC_SPEC_DIR}/{cdi.spec_file_name(member.kind)} when cdi is "
                     "enabled), so none injects")
        self._warn_once(
            f"{member.kind}:{member.device.bdf}:{','.join(sorted(own))}",
            "%s: answering without a CDI name: %s %s; the device nodes are still handed out",
            member.device.bdf, where, " ".join(sorted(own)),
        )
        return None

    def defined(self, qualified_names: Iterable[str], specs: _Loaded | None = None) -> list[str]:
        """The names the host's specs define, in order; one warning per missing name."""
        registry = (specs or self.current()).registry
        out = []
        for name in qualified_names:
            if name in registry:
                out.append(name)
                continue
            self._warn_once(
                name, "CDI device %s is not defined by any spec in %s; answering without it",
                name, " or ".join(self.dirs),
            )
        return out



