"""Point a runtime class's Kata configuration at its installed guest files.

The ``configuration-*.toml`` shipped with the artifacts names its kernel, initrd and
image by paths of the machine it was built on (or bare file names). After install
they live in the runtime class's artifacts dir, so each ``[hypervisor.*]`` table gets
those keys rewritten to the files' host paths. With VFIO cold/hot plug on
``root-port``, every passed-through GPU or NVSwitch needs its own PCIe root port,
so ``pcie_root_port`` is raised to at least that count (never below the shipped value).
``[runtime] pod_resource_device_sources`` says where the shim's cold-plug takes a pod's
devices from: ``device-plugin`` (the kubelet's device-plugin devices) and, with the chart's
``dra.enabled``, ``dra`` (DRA claims). The setting comes from Kata's pending DRA cold-plug
(pull requests #13323, #13420; default ``["device-plugin"]``): Kata 3.25 and 3.29 do not know
it and ignore it (their configuration parser skips unknown keys, as tests/kata shows), so it is
written for the Kata that reads it.

For a Kata that boots a dm-verity EROFS ``image`` (3.29 and later), ``kernel_verity_params``
and each ``guest_extension_images`` entry's ``path`` and ``verity_params`` are written too
(the paths to the installed files, the parameters the install checked the images against:
``katamgr.runtime.guest_images``), in place where the shipped file has them, and a release
that would not read what the config asks for is refused by name.

The shipped file stays as the artifact delivered it (its digest is what the
install record checks); the rewritten copy goes to ``rendered/`` inside the
runtime class's dir, a name no artifact layer can take, and that copy is what
containerd's ``ConfigPath`` names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import tomlkit
from tomlkit.exceptions import TOMLKitError

from gpunode.errors import ConfigError, GpuNodeError
from gpunode.host.files import write_atomic
from gpunode.host.root import HostRoot
from gpunode.policy.katarelease import UNKNOWN, KataRelease
from katamgr.artifacts.errors import ArtifactError
from katamgr.artifacts.manifest import RENDERED_DIR
from katamgr.runtime import guest_images
from katamgr.runtime.tomledit import plain

log = logging.getLogger(__name__)

CONFIG_GLOB = "configuration-*.toml"
ASSET_KEYS = ("kernel", "initrd", "image")
ROOT_PORT = "root-port"
PLUG_KEYS = ("cold_plug_vfio", "hot_plug_vfio")
SOURCES_KEY = "pod_resource_device_sources"
POD_RESOURCE_SOURCES = ("device-plugin", "dra")
DEFAULT_SOURCES = ("device-plugin",)
# Where Kata's GPU configs point the shim at the kubelet's PodResources API.
DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


@dataclass(frozen=True)
class KataConfigResult:
    config_path: str  # host path of the Kata configuration file
    changed: bool
    changes: tuple[str, ...]  # one human-readable line per changed key
    cold_plug_gaps: tuple[str, ...] = ()  # why pods would need the CDI annotation


def cold_plug_gaps(doc: dict, where: str) -> list[str]:
    """Why Kata would not cold-plug a pod's device-plugin GPUs with this config.

    The shim cold-plugs from the kubelet's PodResources API only when a
    hypervisor has ``cold_plug_vfio`` set to a port (not ``no-port``) and
    ``[runtime] pod_resource_api_sock`` names the socket; otherwise a pod has
    to name its GPU itself with a ``cdi.k8s.io/...`` annotation.
    """
    gaps = []
    hypervisors = doc.get("hypervisor")
    tables = hypervisors.values() if isinstance(hypervisors, dict) else []
    ports = [t.get("cold_plug_vfio") for t in tables if isinstance(t, dict)]
    if not any(isinstance(p, str) and p not in ("", "no-port") for p in ports):
        gaps.append(f"{where} does not set cold_plug_vfio (e.g. \"root-port\") in [hypervisor.*]")
    runtime = doc.get("runtime")
    sock = runtime.get("pod_resource_api_sock") if isinstance(runtime, dict) else None
    if not isinstance(sock, str) or not sock:
        gaps.append(f"{where} does not set [runtime] pod_resource_api_sock "
                    "(the kubelet's /var/lib/kubelet/pod-resources/kubelet.sock)")
    if gaps:
        gaps.append("Kata will not cold-plug the GPUs the device plugin gives a pod: each pod must name its "
                    "GPU with the annotation cdi.k8s.io/gpu: nvidia.com/pgpu=<index> instead")
    return gaps


def installed_cold_plug_gaps(host: HostRoot, artifact_dir: Path) -> list[str]:
    """``cold_plug_gaps`` of an installed runtime class's shipped config ([] when none is installed)."""
    try:
        local = find_kata_config(host, artifact_dir)
        doc = tomlkit.parse(local.read_text())
    except (GpuNodeError, OSError, TOMLKitError):
        return []
    return cold_plug_gaps(doc, f"Kata config {host.host_path(local)}")


def find_kata_config(host: HostRoot, artifact_dir: Path) -> Path:
    """The one ``configuration-*.toml`` in ``artifact_dir`` (a local path under ``host``)."""
    found = sorted(p for p in Path(artifact_dir).glob(CONFIG_GLOB) if p.is_file())
    where = host.host_path(Path(artifact_dir))
    if not found:
        raise GpuNodeError(
            f"no {CONFIG_GLOB} in artifacts dir {where}; the runtime class's artifact must "
            f"ship exactly one Kata configuration file"
        )
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise GpuNodeError(
            f"artifacts dir {where} holds several Kata configurations ({names}); "
            f"the artifact must ship exactly one"
        )
    return found[0]


def transform_kata_config(
    host: HostRoot, artifact_dir: Path, root_ports: int = 0,
    device_sources: tuple[str, ...] = DEFAULT_SOURCES, release: KataRelease = UNKNOWN,
) -> KataConfigResult:
    """Rewrite the Kata config in ``artifact_dir`` (local path, reached through ``host``).

    ``root_ports`` is the node's passthrough GPU + NVSwitch count; ``device_sources`` what
    ``[runtime] pod_resource_device_sources`` is set to; ``release`` the Kata that reads it.
    """
    if root_ports < 0:
        raise ConfigError(f"root port count {root_ports} is negative; pass the device count")
    bad = [s for s in device_sources if s not in POD_RESOURCE_SOURCES]
    if bad or not device_sources or len(set(device_sources)) != len(device_sources):
        raise ConfigError(f"{SOURCES_KEY} {list(device_sources)} must list {' and/or '.join(POD_RESOURCE_SOURCES)}, "
                          "each once")
    artifact_dir = Path(artifact_dir)
    local = find_kata_config(host, artifact_dir)
    config_host = host.host_path(local)
    text = local.read_text()
    try:
        doc = tomlkit.parse(text)
    except TOMLKitError as exc:
        raise GpuNodeError(f"Kata config {config_host} is not valid TOML ({exc})") from exc
    hypervisors = doc.get("hypervisor")
    if not isinstance(hypervisors, dict) or not hypervisors:
        raise GpuNodeError(f"Kata config {config_host} has no [hypervisor.*] table")
    problems = guest_images.release_problems(plain(doc), release, f"Kata config {config_host}")
    if problems:
        raise GpuNodeError("; ".join(problems))
    changes: list[str] = []
    annotated = guest_images.annotated_params(artifact_dir)
    for name, table in hypervisors.items():
        if not isinstance(table, dict):
            continue
        section = f"hypervisor.{name}"
        _set_guest_images(host, artifact_dir, table, section, annotated, changes)
        for key in ASSET_KEYS:
            value = table.get(key)
            if not isinstance(value, str) or not value:
                continue  # keep only the keys the shipped config set
            basename = PurePosixPath(value).name
            if basename in ("", ".", ".."):
                raise GpuNodeError(
                    f"{section}.{key} = {value!r} in {config_host} names no file; fix the artifact"
                )
            installed = artifact_dir / basename
            if not installed.is_file():
                raise GpuNodeError(
                    f"{section}.{key} in {config_host} needs {basename}, which is missing "
                    f"from {host.host_path(artifact_dir)}; re-pull the runtime class artifact"
                )
            wanted = host.host_path(installed)
            if value != wanted:
                table[key] = wanted
                changes.append(f"{section}.{key}: {value} -> {wanted}")
        if any(table.get(k) == ROOT_PORT for k in PLUG_KEYS) and root_ports:
            current = plain(table.get("pcie_root_port", 0))
            current = current if isinstance(current, int) else 0
            if root_ports > current:
                table["pcie_root_port"] = root_ports
                changes.append(f"{section}.pcie_root_port: {current} -> {root_ports}")
    _set_device_sources(doc, device_sources, changes)
    _set_pod_resources_socket(doc, host, changes)
    rendered = artifact_dir / RENDERED_DIR / local.name
    rendered_host = host.host_path(rendered)
    changed = write_atomic(rendered, tomlkit.dumps(doc))
    if changed:
        log.info("Kata config %s (from %s): %s", rendered_host, config_host, "; ".join(changes) or "copied")
    gaps = tuple(cold_plug_gaps(doc, f"Kata config {config_host}"))
    return KataConfigResult(rendered_host, changed, tuple(changes) if changed else (), gaps)


def _set_guest_images(host: HostRoot, artifact_dir: Path, table, section: str, annotated: dict[str, str],
                      changes: list[str]) -> None:
    """``kernel_verity_params`` and the extensions' ``path`` and ``verity_params``: the installed
    files and the parameters they were checked against, changed in place (comments kept)."""
    try:
        found = guest_images.images_of(plain(table))
    except ArtifactError as exc:
        raise GpuNodeError(f"{section}: {exc}") from exc
    extensions = table.get(guest_images.EXTENSIONS_KEY)
    for label, file_name, params, extension in found:
        wanted_params = params or annotated.get(file_name, "")
        if not extension:
            if wanted_params and table.get(guest_images.VERITY_KEY) != wanted_params:
                table[guest_images.VERITY_KEY] = wanted_params
                changes.append(f"{section}.{guest_images.VERITY_KEY}: set from the image layer's annotation")
            continue
        installed = artifact_dir / file_name
        if not installed.is_file():
            raise GpuNodeError(f"{section} {label} needs {file_name}, which is missing from "
                               f"{host.host_path(artifact_dir)}; re-pull the runtime class artifact")
        entry = next(e for e in extensions if e.get("name") == extension)
        if entry.get("path") != host.host_path(installed):
            changes.append(f"{section} {label}.path: {entry.get('path')} -> {host.host_path(installed)}")
            entry["path"] = host.host_path(installed)
        if wanted_params and entry.get("verity_params") != wanted_params:
            entry["verity_params"] = wanted_params
            changes.append(f"{section} {label}.verity_params: set from the image layer's annotation")


def _set_device_sources(doc, sources: tuple[str, ...], changes: list[str]) -> None:
    """``[runtime] pod_resource_device_sources`` set to ``sources``, the file's comments kept
    (a key the shipped file has is changed in place; a new one gets a comment saying why)."""
    runtime = doc.get("runtime")
    if runtime is None:
        runtime = tomlkit.table()
        doc["runtime"] = runtime
    wanted = list(sources)
    current = plain(runtime.get(SOURCES_KEY)) if SOURCES_KEY in runtime else None
    if current == wanted:
        return
    array = tomlkit.array()
    array.extend(wanted)
    if SOURCES_KEY in runtime:
        runtime[SOURCES_KEY] = array
    else:
        runtime.add(tomlkit.nl())
        runtime.add(tomlkit.comment("Where the cold-plug takes a pod's devices from: the kubelet's device-plugin "
                                    "devices, and DRA claims (\"dra\"). Set by kata-sandbox-manager to match its "
                                    "chart (dra.enabled); Kata releases without the setting ignore it."))
        runtime.add(SOURCES_KEY, array)
    changes.append(f"runtime.{SOURCES_KEY}: {current} -> {wanted}")


def _set_pod_resources_socket(doc, host: HostRoot, changes: list[str]) -> None:
    """``[runtime] pod_resource_api_sock`` moved below the node's kubelet root dir when that is
    not /var/lib/kubelet (k0s, microk8s): the kubelet serves PodResources at
    <root-dir>/pod-resources/kubelet.sock, where the shim must ask it which devices to cold-plug.
    A socket the shipped config does not name at the default place is left as it is."""
    runtime = doc.get("runtime")
    wanted = f"{host.kubelet_dir.rstrip('/')}/pod-resources/kubelet.sock"
    if not isinstance(runtime, dict) or runtime.get("pod_resource_api_sock") != DEFAULT_POD_RESOURCES_SOCKET:
        return
    if wanted != DEFAULT_POD_RESOURCES_SOCKET:
        runtime["pod_resource_api_sock"] = wanted
        changes.append(f"runtime.pod_resource_api_sock: {DEFAULT_POD_RESOURCES_SOCKET} -> {wanted}")


def rendered_config(host: HostRoot, artifact_dir: Path) -> Path | None:
    """The rewritten Kata config of a runtime class dir, if it has been rendered."""
    try:
        shipped = find_kata_config(host, artifact_dir)
    except GpuNodeError:
        return None
    rendered = Path(artifact_dir) / RENDERED_DIR / shipped.name
    return rendered if rendered.is_file() else None


# ---- a runtime kata-deploy installed: our GPU settings as a drop-in ------------------

# Kata reads every file of ``config.d`` beside its configuration after it, in name order, each
# key overriding the file's (``src/runtime/pkg/katautils/config.go`` ``decodeDropIns``, Kata 3.x
# and 4.x; runtime-rs: ``src/libs/kata-types/src/config/drop_in.rs``). kata-deploy writes its
# own as 10- to 30-; ours comes after them, and is the only file katamgr writes there.
DROP_IN_DIR = "config.d"
DROP_IN_NAME = "90-kata-sandbox-manager.toml"


def drop_in_path(host: HostRoot, config_path: str) -> Path:
    """Where our drop-in for the Kata config ``config_path`` (a host path) goes."""
    return host.path(config_path).parent / DROP_IN_DIR / DROP_IN_NAME


def _effective(host: HostRoot, config_path: str) -> dict:
    """The Kata config as Kata reads it, less our drop-in: the file, then its other drop-ins."""
    local = host.path(config_path)
    try:
        doc = plain(tomlkit.parse(local.read_text()))
    except OSError as exc:
        raise GpuNodeError(f"Kata config {config_path} cannot be read ({exc.strerror or exc})") from exc
    except TOMLKitError as exc:
        raise GpuNodeError(f"Kata config {config_path} is not valid TOML ({exc})") from exc
    directory = local.parent / DROP_IN_DIR
    for drop_in in sorted(directory.iterdir()) if directory.is_dir() else ():
        if drop_in.name == DROP_IN_NAME or not drop_in.is_file():
            continue
        try:
            extra = plain(tomlkit.parse(drop_in.read_text()))
        except (OSError, TOMLKitError):
            continue  # Kata fails on it too; that is kata-deploy's to say
        for section, table in extra.items():
            if isinstance(table, dict) and isinstance(doc.get(section), dict):
                for name, values in table.items():
                    if isinstance(values, dict) and isinstance(doc[section].get(name), dict):
                        doc[section][name] = {**doc[section][name], **values}
                    else:
                        doc[section][name] = values
            else:
                doc[section] = table
    return doc


def write_gpu_drop_in(host: HostRoot, config_path: str, root_ports: int = 0,
                      device_sources: tuple[str, ...] = DEFAULT_SOURCES) -> KataConfigResult:
    """The GPU settings ``transform_kata_config`` renders into our own configs, for a Kata config
    someone else installed (``config_path``, a host path): written as our drop-in beside it,
    never into its files. ``pcie_root_port`` is raised for each hypervisor that plugs VFIO on
    root ports (never lowered); ``[runtime] pod_resource_device_sources`` set."""
    doc = _effective(host, config_path)
    hypervisors = doc.get("hypervisor")
    if not isinstance(hypervisors, dict) or not hypervisors:
        raise GpuNodeError(f"Kata config {config_path} has no [hypervisor.*] table")
    out = tomlkit.document()
    out.add(tomlkit.comment(f"Written by kata-sandbox-manager for {config_path} (installed by another tool, left "
                            "as it is): the GPU settings. Removed by katamgr revert."))
    changes: list[str] = []
    for name, table in hypervisors.items():
        if not isinstance(table, dict) or not any(table.get(k) == ROOT_PORT for k in PLUG_KEYS):
            continue
        current = table.get("pcie_root_port", 0)
        current = current if isinstance(current, int) else 0
        if root_ports > current:
            section = tomlkit.table()
            section["pcie_root_port"] = root_ports
            out.setdefault("hypervisor", tomlkit.table(is_super_table=True))[name] = section
            changes.append(f"hypervisor.{name}.pcie_root_port: {current} -> {root_ports}")
    runtime = doc.get("runtime") if isinstance(doc.get("runtime"), dict) else {}
    wanted = list(device_sources)
    if runtime.get(SOURCES_KEY) != wanted:
        changes.append(f"runtime.{SOURCES_KEY}: {runtime.get(SOURCES_KEY)} -> {wanted}")
    section = tomlkit.table()
    section[SOURCES_KEY] = wanted
    out["runtime"] = section
    local = drop_in_path(host, config_path)
    local.parent.mkdir(parents=True, exist_ok=True)
    changed = write_atomic(local, tomlkit.dumps(out))
    where = host.host_path(local)
    if changed:
        log.info("Kata config drop-in %s (for %s): %s", where, config_path, "; ".join(changes) or "written")
    gaps = tuple(cold_plug_gaps(doc, f"Kata config {config_path}"))
    return KataConfigResult(where, changed, (tuple(changes) or ("GPU settings",)) if changed else (), gaps)


def remove_gpu_drop_ins(host: HostRoot, under: str) -> list[str]:
    """Remove every drop-in of ours below ``under`` (a host path); the host paths removed."""
    base = host.path(under)
    removed = []
    for local in sorted(base.rglob(f"{DROP_IN_DIR}/{DROP_IN_NAME}")) if base.is_dir() else ():
        local.unlink()
        removed.append(host.host_path(local))
    return removed
