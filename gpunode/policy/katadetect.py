"""The Kata runtimes containerd has registered on this node, their release and who installed them.

Read-only, from the node's files through a ``HostRoot``: containerd's config (the main file
and every absolute file its ``imports`` name, in containerd's order), each runtime entry whose
shim is Kata's (the Go shim and runtime-rs alike), the shim binary and its ``ConfigPath``.

The release is what the shim says to ``--version`` (run without a shell, bounded by a
timeout). Kata's Go shim prints
``Kata Containers containerd shim (Golang): id: "io.containerd.kata.v2", version: 3.29.0, commit: ...``
(``src/runtime/cmd/containerd-shim-kata-v2/main.go``), runtime-rs the same with ``(Rust)`` and
the id unquoted (``src/runtime-rs/crates/shim/src/bin/main.rs`` ``show_version``). Where the
shim cannot be run, the install's ``VERSION`` file (the release tarball that kata-deploy unpacks
records one at its prefix: ``tools/packaging/kata-deploy/local-build/kata-deploy-merge-builds.sh``)
answers instead.

kata-deploy's layout (``tools/packaging/kata-deploy/binary/src``, Kata 3.2x-4.x): it installs
under ``/opt/kata`` (``config.rs`` ``DEFAULT_KATA_INSTALL_DIR``), the Go shim at
``/opt/kata/bin/containerd-shim-kata-v2`` and runtime-rs's at
``/opt/kata/runtime-rs/bin/containerd-shim-kata-v2`` (``utils/system.rs``
``get_kata_containers_runtime_path``); each class's config is
``/opt/kata/share/defaults/kata-containers[/runtime-rs]/runtimes/<shim>/configuration-<shim>.toml``
with a ``config.d`` of drop-ins beside it (``get_kata_containers_config_path``,
``artifacts/install.rs``); its containerd entries are named ``kata-<shim>`` (``config.rs``
``shim_handler``: ``kata-qemu-nvidia-gpu``, ``kata-qemu-nvidia-gpu-snp``, ``-tdx``,
``kata-qemu-nvidia-gpu-runtime-rs``...), with ``runtime_type = "io.containerd.kata-<shim>.v2"``
and ``runtime_path`` set (``runtime/containerd.rs`` ``write_containerd_runtime_config``), in a
drop-in named ``kata-deploy.toml`` (``/opt/kata/containerd/config.d/`` imported by the main
config, or ``/etc/containerd/conf.d/`` on containerd 2.2 and later).

The paths in containerd's config (``imports``, ``runtime_path``, ``ConfigPath``) are the
paths containerd opens: where the node's ``/`` is elsewhere for containerd
(``HostRoot.runtime_root``, the chart's ``hostPaths.rootFS``: hack/local-cluster's node, whose
kata-deploy install has that prefix, ``INSTALLATION_PREFIX`` in kata-deploy's ``config.rs``)
they are read back as host paths.

``katamgr.runtime.containerd`` is the one place that edits containerd's config; this module only
reads it (the host layer is below the runtime layer), looking for runtimes in every plugin table
that has ``containerd.runtimes`` (config versions 2, 3 and 4 alike).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import logging
import posixpath
import re
import subprocess
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpunode.host.root import HostRoot
from gpunode.kataclasses import DEFAULT_RUNTIME_CLASSES, KATA_GPU_HANDLERS
from gpunode.policy.kata import release_json
from gpunode.policy.katarelease import UNKNOWN, KataRelease, parse_release
from gpunode.policy.selection import KATA_VERSION_FLAG, NvswitchRule

log = logging.getLogger(__name__)

# The node label katamgr publishes with the release found (kata-deploy names its own
# objects' release katacontainers.io/kata-version, helm-chart/kata-deploy/templates/_helpers.tpl,
# and marks a node it installed katacontainers.io/kata-runtime=true, binary/src/main.rs).
RELEASE_LABEL = "katacontainers.io/kata-version"
# containerd's config where none is configured (katamgr.runtime.settings.DEFAULT_CONFIG_PATH, the
# same: not imported here, so that a plan loads no TOML editor).
CONTAINERD_CONFIG = "/etc/containerd/config.toml"
KATA_DEPLOY_DIR = "/opt/kata"
KATA_DEPLOY = "kata-deploy"
KATAMGR = "katamgr"
PACKAGE = "package"
UNKNOWN_SOURCE = "unknown"

GO, RUST = "go", "runtime-rs"
SHIM_NAME = "containerd-shim-kata-v2"
VERSION_TIMEOUT_S = 5.0
# Where a distribution package puts Kata (its shim in the system's bin, its configs in
# /usr/share/defaults/kata-containers, an operator's in /etc/kata-containers).
PACKAGE_DIRS = ("/usr/bin/", "/usr/share/defaults/kata-containers/", "/etc/kata-containers/")
# containerd finds a shim named by runtime_type alone on its PATH.
SHIM_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")

_KATA_TYPE = re.compile(r"^io\.containerd\.kata(-[a-z0-9-]+)?\.v2$")
_SHIM_VERSION = re.compile(r"containerd shim \((?P<lang>Golang|Rust)\): id: \"?[^\",]*\"?, "
                           r"version: v?(?P<version>\d+\.\d+(?:\.\d+)?)")
_VERSION_FILE = re.compile(r"^v?(\d+\.\d+(?:\.\d+)?)")


@dataclass(frozen=True)
class FoundRuntime:
    """One Kata runtime containerd has registered."""

    name: str  # the runtime entry, the RuntimeClass handler
    shim: str | None  # host path of the shim binary; None: not found
    config_path: str | None  # its ConfigPath option (None: the shim's default)
    flavour: str  # GO or RUST
    release: KataRelease
    release_from: str  # how the release was learnt, in words
    installed_by: str  # KATA_DEPLOY, KATAMGR, PACKAGE or UNKNOWN_SOURCE
    defined_in: str  # the containerd file that registers it

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shim": self.shim, "config_path": self.config_path,
                "flavour": self.flavour, "release": release_json(self.release),
                "release_from": self.release_from, "installed_by": self.installed_by,
                "defined_in": self.defined_in}

    def line(self) -> str:
        return (f"{self.name}: {self.release} ({self.flavour}, {self.release_from}), installed by "
                f"{self.installed_by}; shim {self.shim or 'not found'}, config "
                f"{self.config_path or 'the shim default'}")


@dataclass(frozen=True)
class KataOnNode:
    """What :func:`detect` found: the Kata runtimes, and what could not be read."""

    runtimes: tuple[FoundRuntime, ...] = ()
    problems: tuple[str, ...] = field(default=())
    # The release that decides for the classes katamgr serves (set by ``with_found``), and
    # whether it took the place of an empty devices.kataVersion.
    release: KataRelease = UNKNOWN
    decides: bool = False
    # Why the release typed by hand is not the one found ("": it is, or none was typed).
    warning: str = ""

    def release_for(self, names: Iterable[str] = ()) -> KataRelease:
        """The release that decides for the runtimes ``names`` (every Kata runtime found when
        none of them is): the oldest one found, the safe guess when they differ."""
        wanted = set(names)
        chosen = [r for r in self.runtimes if r.name in wanted] or list(self.runtimes)
        known = [r.release.version for r in chosen if r.release.version is not None]
        return KataRelease(min(known)) if known else UNKNOWN

    def installed_by(self, source: str) -> tuple[str, ...]:
        return tuple(r.name for r in self.runtimes if r.installed_by == source)

    def to_json(self) -> dict[str, Any]:
        return {"release": release_json(self.release), "runtimes": [r.to_json() for r in self.runtimes],
                "problems": list(self.problems)}


NOTHING = KataOnNode()

VersionReader = Callable[[Path], str]


def run_version(shim: Path) -> str:
    """``shim --version``'s output: no shell, no input, bounded (OSError or
    subprocess.SubprocessError when it cannot run or does not finish)."""
    done = subprocess.run([str(shim), "--version"], stdin=subprocess.DEVNULL, capture_output=True,
                          timeout=VERSION_TIMEOUT_S, check=False, text=True, errors="replace")
    return done.stdout + done.stderr


def parse_shim_version(text: str) -> tuple[KataRelease, str] | None:
    """The release and flavour a shim's ``--version`` names, or None."""
    found = _SHIM_VERSION.search(text)
    if not found:
        return None
    return parse_release(found["version"]), RUST if found["lang"] == "Rust" else GO


def detect(host: HostRoot, containerd_config: str, *, artifacts_dir: str = "",
           read_version: VersionReader = run_version) -> KataOnNode:
    """The Kata runtimes the containerd config at ``containerd_config`` (a host path)
    registers, with their releases; ``artifacts_dir``: where katamgr installs its own."""
    problems: list[str] = []
    entries: dict[str, tuple[Mapping[str, Any], str]] = {}
    for host_path in _config_files(host, containerd_config, problems):
        for name, entry in _runtime_entries(host, host_path, problems):
            entries[name] = (entry, host_path)  # a later file's entry wins, as in containerd
    found = []
    for name, (entry, defined_in) in sorted(entries.items()):
        runtime = _found(host, name, entry, defined_in, artifacts_dir, read_version, problems)
        if runtime is not None:
            found.append(runtime)
    return KataOnNode(tuple(found), tuple(problems))


def _read(host: HostRoot, host_path: str, problems: list[str]) -> dict[str, Any] | None:
    try:
        return tomllib.loads(host.path(host_path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        problems.append(f"{host_path} could not be read for its Kata runtimes: {exc}")
        return None


def _config_files(host: HostRoot, main: str, problems: list[str]) -> list[str]:
    doc = _read(host, main, problems)
    if doc is None:
        return []
    files = [main]
    imports = doc.get("imports")
    for pattern in imports if isinstance(imports, list) else []:
        if not isinstance(pattern, str) or not posixpath.isabs(pattern):
            continue  # containerd resolves a relative import against its own cwd
        for local in sorted(glob.glob(str(host.path(host.host_node(pattern))))):
            files.append(host.host_path(Path(local)))
    return files


def _runtime_entries(host: HostRoot, host_path: str, problems: list[str]):
    doc = _read(host, host_path, problems)
    plugins = doc.get("plugins") if doc else None
    for plugin in plugins.values() if isinstance(plugins, dict) else ():
        runtimes = plugin.get("containerd", {}).get("runtimes") if isinstance(plugin, dict) else None
        for name, entry in runtimes.items() if isinstance(runtimes, dict) else ():
            if isinstance(entry, dict) and _is_kata(entry):
                yield name, entry


def _is_kata(entry: Mapping[str, Any]) -> bool:
    runtime_type = entry.get("runtime_type")
    path = entry.get("runtime_path")
    return (isinstance(runtime_type, str) and bool(_KATA_TYPE.match(runtime_type))) or (
        isinstance(path, str) and posixpath.basename(path) == SHIM_NAME)


def _shim_of(host: HostRoot, entry: Mapping[str, Any]) -> str | None:
    path = entry.get("runtime_path")
    if isinstance(path, str) and path:
        return host.host_node(path)
    # containerd's shim for io.containerd.<name>.<version> is containerd-shim-<name>-<version>.
    runtime_type = str(entry.get("runtime_type", ""))
    parts = runtime_type.split(".")
    binary = f"containerd-shim-{'-'.join(parts[2:])}" if len(parts) >= 4 else SHIM_NAME
    for directory in SHIM_PATH:
        candidate = f"{directory}/{binary}"
        if host.path(candidate).is_file():
            return candidate
    return None


def _found(host: HostRoot, name: str, entry: Mapping[str, Any], defined_in: str, artifacts_dir: str,
           read_version: VersionReader, problems: list[str]) -> FoundRuntime | None:
    options = entry.get("options")
    config = options.get("ConfigPath") if isinstance(options, dict) else None
    config = host.host_node(config) if isinstance(config, str) and config else None
    shim = _shim_of(host, entry)
    release, flavour, how = UNKNOWN, None, "no shim found"
    if shim is not None:
        release, flavour, how = _release(host, shim, read_version)
    if flavour is None:
        flavour = RUST if "/runtime-rs/" in f"{shim or ''} {config or ''}" else GO
    if release.version is None:
        problems.append(f"the release of Kata runtime {name} is unknown ({how})")
    return FoundRuntime(name, shim, config, flavour, release, how,
                        _installed_by(shim, config, defined_in, artifacts_dir), defined_in)


def _release(host: HostRoot, shim: str, read_version: VersionReader) -> tuple[KataRelease, str | None, str]:
    local = host.path(shim)
    try:
        text = read_version(local)
    except (OSError, subprocess.SubprocessError) as exc:
        text, why = "", f"{shim} --version failed: {_why_not(exc)}"
    else:
        why = f"{shim} --version printed no Kata release"
    parsed = parse_shim_version(text)
    if parsed is not None:
        return parsed[0], parsed[1], f"{posixpath.basename(shim)} --version"
    for version_file in _version_files(shim):
        try:
            found = _VERSION_FILE.match(host.path(version_file).read_text().strip())
        except OSError:
            continue
        if found:
            return parse_release(found[1]), None, f"{version_file}, as {why}"
    return UNKNOWN, None, why


def _why_not(exc: OSError | subprocess.SubprocessError) -> str:
    """Why the shim did not run, without the path this process reached it by (the host root
    this runs under): the message is shown with the host's path."""
    if isinstance(exc, subprocess.TimeoutExpired):
        return f"timed out after {exc.timeout:g} s"
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    return type(exc).__name__


def _version_files(shim: str) -> list[str]:
    """The install's VERSION file: at the prefix above its bin/ (above runtime-rs/ too)."""
    prefix = posixpath.dirname(posixpath.dirname(shim))
    out = [posixpath.join(prefix, "VERSION")]
    if posixpath.basename(prefix) == "runtime-rs":
        out.append(posixpath.join(posixpath.dirname(prefix), "VERSION"))
    return out


def _under(path: str | None, directory: str) -> bool:
    return bool(path) and bool(directory) and path.startswith(directory.rstrip("/") + "/")


def _installed_by(shim: str | None, config: str | None, defined_in: str, artifacts_dir: str) -> str:
    if _under(config, artifacts_dir):
        return KATAMGR
    if (_under(shim, KATA_DEPLOY_DIR) or _under(config, KATA_DEPLOY_DIR)
            or posixpath.basename(defined_in).startswith(KATA_DEPLOY)):
        return KATA_DEPLOY
    if any((shim or "").startswith(d) or (config or "").startswith(d) for d in PACKAGE_DIRS):
        return PACKAGE
    return UNKNOWN_SOURCE


def gpu_runtimes(found: KataOnNode) -> tuple[str, ...]:
    """The Kata GPU runtimes found (named as Kata GPU handlers: kata-deploy's and katamgr's)."""
    return tuple(r.name for r in found.runtimes
                 if any(fnmatch.fnmatchcase(r.name, p) for p in KATA_GPU_HANDLERS))


def deciding_runtimes(found: KataOnNode, names: Iterable[str] | None = None) -> tuple[str, ...]:
    """The runtimes whose release decides: those of ``names`` found on the node (the runtime
    classes configured; None: the agent's defaults, ``DEFAULT_RUNTIME_CLASSES``, which the
    device plugin and the DRA driver take too, knowing no classes), else every Kata GPU runtime
    found. One rule for every part: on a node with two installs (kata-deploy's at /opt/kata
    and a second one under another multiInstallSuffix) the classes pods are given decide,
    not the oldest install."""
    wanted = set(DEFAULT_RUNTIME_CLASSES if names is None else names)
    return tuple(r.name for r in found.runtimes if r.name in wanted) or gpu_runtimes(found)


def on_node(rule: NvswitchRule, host: HostRoot, containerd_config: str, *,
            artifacts_dir: str = "", names: Iterable[str] | None = None,
            read_version: VersionReader = run_version) -> tuple[NvswitchRule, KataOnNode]:
    """``rule`` deciding by the Kata found on the node now (``detect``, then
    ``with_found``), and what was found: the one way katamgr's plan and agent, the device
    plugin and the DRA driver learn the node's Kata (through ``gpunode.services.nodecontext``).
    ``rule`` holds the release the operator gave (a typed release stays the override);
    ``names``: the runtime classes configured (None: the agent's defaults), whose release
    decides (``deciding_runtimes``)."""
    found = detect(host, containerd_config, artifacts_dir=artifacts_dir, read_version=read_version)
    for problem in found.problems:
        log.info("%s", problem)
    return with_found(rule, found, deciding_runtimes(found, names))


def inputs(host: HostRoot, containerd_config: str, found: KataOnNode | None) -> tuple[tuple, ...]:
    """What ``detect`` read, each file as (host path, mtime, size, inode; None where it is
    missing): containerd's config files and each runtime's shim, ConfigPath and VERSION files.
    kata-deploy installing or upgrading Kata changes one of them (it writes its containerd
    drop-in and replaces the shim and VERSION under /opt/kata), so a caller that keeps these
    detects again only when they differ, without running a shim every time it looks."""
    paths = _config_files(host, containerd_config, [])
    for runtime in found.runtimes if found is not None else ():
        for path in (runtime.shim, runtime.config_path, *(_version_files(runtime.shim) if runtime.shim else ())):
            if path:
                paths.append(path)
    out = []
    for path in [containerd_config, *paths]:
        try:
            st = host.path(path).stat()
        except OSError:
            out.append((path, None))
        else:
            out.append((path, st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


def with_found(rule: NvswitchRule, found: KataOnNode, names: Iterable[str] = ()) -> tuple[NvswitchRule, KataOnNode]:
    """``rule`` deciding by the release of the Kata runtimes ``names`` found on the node
    (``found.release_for``) where no release was typed (``devices.kataVersion``,
    ``--kata-version``), and ``found`` with that release; a typed one stays the override, with
    a warning (``found.warning``) when it is not the release found."""
    detected = found.release_for(names)
    found = dataclasses.replace(found, release=detected)
    if rule.kata.version is None:
        found = dataclasses.replace(found, decides=detected.version is not None)
        return dataclasses.replace(rule, kata=detected), found
    warning = ""
    if detected.version is not None and detected.version != rule.kata.version:
        runtimes = ", ".join(r.name for r in found.runtimes if r.release == detected)
        warning = (f"devices.kataVersion ({KATA_VERSION_FLAG}) says the node runs {rule.kata}, but its "
                   f"Kata runtimes {runtimes} are {detected}: {rule.kata} decides what Kata can "
                   f"cold-plug (NVSwitches) until the typed release is corrected or removed")
    return rule, dataclasses.replace(found, warning=warning)
