"""Whether the Kata artifacts a node runs are the ones its config asks for, whole and loadable.

After each reconcile the agent verifies every runtime class it installs:

- the install's record names the reference the config asks for: a new artifact that could not
  be installed (a corrupt blob, a registry that is down) leaves the old one running, and the
  node must not count as upgraded;
- every recorded file still has its recorded sha256 (re-hashed in full, once per install);
- the rendered Kata config is valid TOML with a ``[hypervisor.*]`` table, and every kernel,
  initrd and image it names is an installed file of that class's dir: what Kata's own
  ``LoadConfiguration`` resolves before it starts a VM (``katautils/config.go``: the
  hypervisor's asset paths must exist). This is our own loader check; the node's
  ``kata-runtime env`` is not run, since the agent sees the host below ``--host-root``
  while the config names host paths (tests/kata holds Kata's own parser to the rendered config).

The result goes to ``verified.json`` in katamgr's state dir, stamped with the agent that wrote
it, and ``/readyz`` reads it back: a DaemonSet rollout waits on the new agent's readiness, so a
bad artifact stops the rollout on the first node (docs/operating.md, "Upgrading node by node").
A running VM keeps the files it booted: an install swaps a whole new dir in, and the old
files live on while QEMU holds them open.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import tomlkit
from tomlkit.exceptions import TOMLKitError

from gpunode.host.files import write_atomic
from gpunode.host.root import HostRoot
from katamgr.artifacts import read_install
from katamgr.artifacts.record import InstallRecord, file_digest
from katamgr.pipeline.kata_runtime import VERIFIED_NAME, KataContext, class_dir, kata_deploy_runtime
from katamgr.runtime.kata_config import ASSET_KEYS, rendered_config

log = logging.getLogger(__name__)

CHECKS = ("reference", "hashes", "config")  # what a class passed, in the order they run


@dataclass(frozen=True)
class ClassVerdict:
    name: str
    ok: bool
    ref: str | None = None  # the reference installed (None: nothing installed)
    digest: str | None = None
    problems: tuple[str, ...] = ()
    note: str = ""  # e.g. kata-deploy's runtime: its files are kata-deploy's

    def to_json(self) -> dict:
        return {"name": self.name, "ok": self.ok, "ref": self.ref, "digest": self.digest,
                "problems": list(self.problems), "note": self.note}


@dataclass(frozen=True)
class Verification:
    """What one verification found, and which agent wrote it (``writer``)."""

    ok: bool
    classes: tuple[ClassVerdict, ...] = ()
    writer: str = ""
    at: float = field(default_factory=time.time)

    def problems(self) -> list[str]:
        return [p for c in self.classes for p in c.problems]

    def to_json(self) -> dict:
        return {"ok": self.ok, "writer": self.writer, "at": self.at, "checks": list(CHECKS),
                "runtimeClasses": [c.to_json() for c in self.classes]}


def verify_class(host: HostRoot, ctx: KataContext, name: str, url: str, *, full: bool = True) -> ClassVerdict:
    """One runtime class: the reference, every file's hash, the rendered config's assets."""
    if kata_deploy_runtime(ctx, name) is not None:
        return ClassVerdict(name, True, note="kata-deploy's runtime: its files are kata-deploy's to verify")
    where = class_dir(ctx.config, name)
    dest = host.path(where)
    record = read_install(dest)
    if record is None:
        return ClassVerdict(name, False, problems=(
            f"runtime class {name}: nothing is installed in {where}; the artifact {url} was not installed "
            "(the agent's log and Events say why)",))
    problems = []
    if record.ref != url:
        problems.append(f"runtime class {name}: {where} holds {record.ref} ({record.digest[:19]}...), not {url} "
                        "as the config asks: the new artifact was not installed (the agent's log and Events "
                        "say why); fix the artifact or roll back (helm rollback)")
    problems += _hash_problems(name, where, dest, record, full)
    problems += _config_problems(host, name, where, dest, record)
    return ClassVerdict(name, not problems, record.ref, record.digest, tuple(problems))


def _hash_problems(name: str, where: str, dest: Path, record: InstallRecord, full: bool) -> list[str]:
    problems = []
    for entry in record.files:
        path = dest / entry.name
        try:
            stat = path.lstat()
            whole = path.is_file() and not path.is_symlink() and stat.st_size == entry.size
            if whole and (full or stat.st_mtime_ns != entry.mtime_ns):
                whole = file_digest(path) == entry.digest
        except OSError:
            whole = False
        if not whole:
            problems.append(f"runtime class {name}: {where}/{entry.name} is not the installed file (sha256 "
                            f"{entry.digest[:19]}..., {entry.size} bytes): changed or removed since the install; "
                            "the next reconcile re-installs it")
    return problems


def _config_problems(host: HostRoot, name: str, where: str, dest: Path, record: InstallRecord) -> list[str]:
    rendered = rendered_config(host, dest)
    if rendered is None:
        return [f"runtime class {name}: no rendered Kata config in {where}/rendered; the reconcile that "
                "installed it failed to render it (the agent's log says why)"]
    shown = host.host_path(rendered)
    try:
        doc = tomlkit.parse(rendered.read_text())
    except (OSError, TOMLKitError) as exc:
        return [f"runtime class {name}: the rendered Kata config {shown} cannot be loaded: {exc}"]
    hypervisors = doc.get("hypervisor")
    if not isinstance(hypervisors, dict) or not hypervisors:
        return [f"runtime class {name}: the rendered Kata config {shown} has no [hypervisor.*] table, "
                "so Kata cannot start a VM with it"]
    installed = {f.name for f in record.files}
    problems = []
    for hv, table in hypervisors.items():
        if not isinstance(table, dict):
            continue
        for key in ASSET_KEYS:
            value = table.get(key)
            if not isinstance(value, str) or not value:
                continue
            path = PurePosixPath(value)
            if str(path.parent) != where.rstrip("/") or path.name not in installed or not host.path(value).is_file():
                problems.append(f"runtime class {name}: hypervisor.{hv}.{key} in {shown} names {value}, which is "
                                f"not an installed file of {where}; Kata would refuse to start a VM with it")
    return problems


class Verifier:
    """Verifies after each reconcile; an unchanged install (same record, same file times) is not
    hashed again, so a reconcile every few minutes does not re-read gigabytes of guest images."""

    def __init__(self, writer: str) -> None:
        self.writer = writer
        self._seen: dict[str, tuple[object, ClassVerdict]] = {}
        self.last: Verification | None = None

    def verify(self, host: HostRoot, ctx: KataContext | None, *, kata: bool = True) -> Verification:
        verdicts = []
        if ctx is not None and kata:
            for rc in ctx.config.runtime_classes:
                key = _install_key(host, ctx, rc.name, rc.artifacts.url)
                seen = self._seen.get(rc.name)
                if seen is not None and seen[0] == key:
                    verdicts.append(seen[1])
                    continue
                verdict = verify_class(host, ctx, rc.name, rc.artifacts.url)
                self._seen[rc.name] = (key, verdict)
                verdicts.append(verdict)
        result = Verification(all(v.ok for v in verdicts), tuple(verdicts), self.writer)
        if result.ok != (self.last.ok if self.last else None) or result.problems() != (
                self.last.problems() if self.last else []):
            if result.ok:
                log.info("Kata artifacts verified: %s", ", ".join(v.name for v in verdicts) or "none to verify")
            else:
                log.warning("Kata artifacts failed verification: %s", "; ".join(result.problems()))
        # The same verdict is not written again: a host write only when something changed (and
        # ``at`` stays the time it was first reached), unless the file is gone or another's.
        kept = read(host)
        if (self.last is not None and (self.last.ok, self.last.classes) == (result.ok, result.classes)
                and kept is not None and kept.writer == self.writer):
            return self.last
        write(host, result)
        self.last = result
        return result


def _install_key(host: HostRoot, ctx: KataContext, name: str, url: str) -> object:
    """What a verdict depends on: the record, the files' sizes and times, the rendered config's."""
    dest = host.path(class_dir(ctx.config, name))
    record = read_install(dest)
    stats = []
    for entry in (record.files if record else ()):
        try:
            stat = (dest / entry.name).stat()
            stats.append((entry.name, stat.st_size, stat.st_mtime_ns))
        except OSError:
            stats.append((entry.name, -1, -1))
    rendered = rendered_config(host, dest)
    rendered_at = rendered.stat().st_mtime_ns if rendered is not None else None
    return (url, record.text() if record else None, tuple(stats), rendered_at, kata_deploy_runtime(ctx, name))


def write(host: HostRoot, verification: Verification) -> None:
    path = host.state_path(VERIFIED_NAME)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(verification.to_json(), indent=2, sort_keys=True) + "\n", marked=False)


def read(host: HostRoot) -> Verification | None:
    """``verified.json`` as the agent last wrote it (None: none, or unreadable)."""
    try:
        doc = json.loads(host.state_path(VERIFIED_NAME).read_text())
        classes = tuple(ClassVerdict(c["name"], bool(c["ok"]), c.get("ref"), c.get("digest"),
                                     tuple(c.get("problems") or ()), c.get("note") or "")
                        for c in doc["runtimeClasses"])
        return Verification(bool(doc["ok"]), classes, str(doc["writer"]), float(doc["at"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def readiness(host: HostRoot, writer: str) -> tuple[bool, str]:
    """The gate on ``/readyz``: ``verified.json`` was written by this agent and says ok."""
    found = read(host)
    shown = host.host_path(host.state_path(VERIFIED_NAME))
    if found is None or found.writer != writer:
        return False, f"this agent has not verified the node's Kata artifacts yet ({shown})"
    if not found.ok:
        return False, "the node's Kata artifacts failed verification: " + "; ".join(found.problems())
    return True, f"Kata artifacts verified ({', '.join(c.name for c in found.classes) or 'none installed here'})"
