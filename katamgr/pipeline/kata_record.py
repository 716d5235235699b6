"""What the Kata step installed on this node, recorded where revert finds it without a config.

``/var/lib/kata-sandbox-manager/kata.json`` lists each runtime class dir katamgr installed
artifacts into (its ref, since when), each containerd config it edited (with how
containerd is reloaded there) and each drop-in it wrote beside kata-deploy's configs. Each
is noted BEFORE the write it names, the way the device and CDI records are, so a run
killed mid-write leaves a record of what may be there; revert acts on what it finds (an
artifacts dir without our install record in it is never removed, a containerd config
with no edit state of ours is left). Revert then undoes exactly this, whatever config it
is given: an apply with one ``artifactsDir`` and a revert with another still removes the
first one's files, and a class whose dir moved keeps the earlier dir listed until then.

The other records stay where they were (``vfio.json``: each device's driver before;
``cdi.json``: the spec kinds; ``containerd/*.json``: the edits, byte for byte); this one
adds what only the Kata step knew.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpunode.host.files import read_json, remove_file, write_json
from gpunode.host.root import HostRoot
from gpunode.services.journal import now
from katamgr import __version__

STATE_FILE = "kata.json"


@dataclass(frozen=True)
class InstalledClass:
    name: str
    dir: str  # host path of the runtime class dir
    ref: str  # the artifact reference it was installed from
    since: str


@dataclass(frozen=True)
class EditedContainerd:
    config_path: str
    restart_mode: str
    socket: str
    since: str


@dataclass(frozen=True)
class KataRecord:
    runtime_classes: tuple[InstalledClass, ...] = ()
    containerd: tuple[EditedContainerd, ...] = ()
    drop_ins: tuple[str, ...] = ()
    since: str | None = None
    version: str | None = None  # katamgr's version that last wrote the record

    @property
    def empty(self) -> bool:
        return not (self.runtime_classes or self.containerd or self.drop_ins)


def _read(host: HostRoot) -> dict[str, Any]:
    try:
        data = read_json(host.state_path(STATE_FILE), {})
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def load(host: HostRoot) -> KataRecord:
    """The record (empty when there is none or it cannot be read: revert then falls back
    to the config it is given)."""
    data = _read(host)
    try:
        classes = tuple(InstalledClass(name, str(v["dir"]), str(v.get("ref", "")), str(v.get("since", "")))
                        for name, v in sorted(data.get("runtimeClasses", {}).items()))
        classes += tuple(InstalledClass(str(e["name"]), str(e["dir"]), str(e.get("ref", "")), str(e.get("since", "")))
                         for e in data.get("earlierDirs", []))
        edited = tuple(EditedContainerd(path, str(v.get("restartMode", "")), str(v.get("socket", "")),
                                        str(v.get("since", "")))
                       for path, v in sorted(data.get("containerd", {}).items()))
        drop_ins = tuple(str(p) for p in data.get("dropIns", []))
    except (AttributeError, KeyError, TypeError):
        return KataRecord()
    return KataRecord(classes, edited, drop_ins, data.get("since"), data.get("version"))


def _note(host: HostRoot, key: str, name: str, value: dict[str, Any] | None) -> None:
    """Add ``name`` under ``key`` (keeping the first ``since``); a no-op write when unchanged."""
    data = _read(host)
    data.setdefault("since", now())
    data["version"] = __version__
    if value is None:
        items = list(data.get(key, []))
        if name not in items:
            data[key] = sorted([*items, name])
    else:
        entries = dict(data.get(key, {}))
        before = entries.get(name, {})
        if key == "runtimeClasses":
            _keep_earlier_dir(data, name, before, value["dir"])
        # What else the entry holds (a pending reload) stays.
        entries[name] = {**before, **value, "since": before.get("since") or now()}
        data[key] = entries
    write_json(host.state_path(STATE_FILE), data)


def _keep_earlier_dir(data: dict[str, Any], name: str, before: dict[str, Any], directory: str) -> None:
    """A class whose dir moved (``artifactsDir`` changed) keeps its earlier dir in the record
    (``earlierDirs``) until revert removes it: its files are still on the node."""
    earlier = [e for e in data.get("earlierDirs", []) if e.get("dir") != directory]
    if before.get("dir") and before["dir"] != directory and all(e.get("dir") != before["dir"] for e in earlier):
        earlier.append({"name": name, "dir": before["dir"], "ref": before.get("ref", ""),
                        "since": before.get("since", "")})
    if earlier or "earlierDirs" in data:
        data["earlierDirs"] = earlier


def note_class(host: HostRoot, name: str, directory: str, ref: str) -> None:
    """Runtime class ``name``'s artifacts are about to be installed into ``directory``."""
    _note(host, "runtimeClasses", name, {"dir": directory, "ref": ref})


def note_containerd(host: HostRoot, config_path: str, restart_mode: str, socket: str) -> None:
    """containerd's config ``config_path`` is about to be edited."""
    _note(host, "containerd", config_path, {"restartMode": restart_mode, "socket": socket})


def note_drop_in(host: HostRoot, path: str) -> None:
    """A drop-in of ours is about to be written at host path ``path``."""
    _note(host, "dropIns", path, None)


def mark_reload(host: HostRoot, config_path: str, pending: str | None) -> None:
    """containerd has (None) or has not (why) read the edit of ``config_path``."""
    data = _read(host)
    entry = data.get("containerd", {}).get(config_path)
    if not isinstance(entry, dict) or entry.get("reloadPending") == pending:
        return
    if pending is None:
        entry.pop("reloadPending", None)
    else:
        entry["reloadPending"] = pending
    write_json(host.state_path(STATE_FILE), data)


def reload_pending(host: HostRoot, config_path: str) -> str | None:
    """Why containerd has not read katamgr's edit of ``config_path`` (None: it has)."""
    entry = _read(host).get("containerd", {}).get(config_path)
    return entry.get("reloadPending") if isinstance(entry, dict) else None


def forget(host: HostRoot) -> None:
    remove_file(host.state_path(STATE_FILE))


def recorded(host: HostRoot) -> bool:
    return host.state_path(STATE_FILE).is_file()


def changes_recorded(host: HostRoot) -> bool:
    """Whether katamgr holds revert state for a containerd config on this node."""
    directory = host.state_path("containerd")
    return directory.is_dir() and any(p.suffix == ".json" for p in directory.iterdir())
