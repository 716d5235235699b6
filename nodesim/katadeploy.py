"""Kata laid out on a simulated node the way kata-deploy installs it (host profile key ``kata``).

What kata-deploy's installer writes (``tools/packaging/kata-deploy/binary/src`` in
kata-containers, facts only): everything under ``/opt/kata`` (``config.rs``
``DEFAULT_KATA_INSTALL_DIR``) with the release tarball's ``VERSION`` at its top
(``local-build/kata-deploy-merge-builds.sh``); the Go shim at ``bin/containerd-shim-kata-v2``,
runtime-rs's at ``runtime-rs/bin/containerd-shim-kata-v2`` (``utils/system.rs``
``get_kata_containers_runtime_path``); each shim's shipped config in
``share/defaults/kata-containers[/runtime-rs]/configuration-<shim>.toml`` and the one containerd
names in ``.../runtimes/<shim>/configuration-<shim>.toml`` with a ``config.d`` beside it
(``get_kata_containers_config_path``, ``artifacts/install.rs``); one containerd runtime per shim,
named ``kata-<shim>`` (``config.rs`` ``shim_handler``), ``runtime_type =
"io.containerd.kata-<shim>.v2"``, ``runtime_path`` and ``options.ConfigPath`` set
(``runtime/containerd.rs`` ``write_containerd_runtime_config``), in the drop-in
``/opt/kata/containerd/config.d/kata-deploy.toml`` that the main config imports, or, with
containerd 2.2 and later whose config imports ``/etc/containerd/conf.d``,
``/etc/containerd/conf.d/kata-deploy.toml`` (``config.rs`` ``get_containerd_paths``).

``install_files``, ``drop_in`` and ``with_import`` are also how the real node of tests/node
gets Kata as kata-deploy installs it (``tests/support/katadeploynode.py``): there the shims are
one Go stand-in that runs containerd's runc shim under Kata's options
(``hack/containerd/kata-shim``) and the paths carry kata-deploy's ``INSTALLATION_PREFIX``.

On simulated nodes the shims are stand-ins: shell scripts that answer ``--version`` in the format of Kata's own
(``src/runtime/cmd/containerd-shim-kata-v2/main.go``: ``... containerd shim (Golang): id:
"io.containerd.kata.v2", version: X, commit: Y``; ``src/runtime-rs/crates/shim/src/bin/main.rs``
``show_version``: ``(Rust)``, the id unquoted) and fail anything else. The Kata configs carry only
what a stand-in node needs to be recognisable; they are not Kata's.
"""

from __future__ import annotations

import json
import os
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path

from gpunode.host.root import HostRoot

PREFIX = "/opt/kata"
GO, RUST = "go", "runtime-rs"
SHIMS = (GO, RUST)
# The NVIDIA GPU shims kata-deploy's chart ships (helm-chart/kata-deploy/try-kata-nvidia-gpu.values.yaml).
GPU_SHIMS = ("qemu-nvidia-gpu", "qemu-nvidia-gpu-snp", "qemu-nvidia-gpu-tdx")
# Where kata-deploy writes its containerd drop-in when the main config does not import
# /etc/containerd/conf.d (config.rs containerd_drop_in_conf_file, get_containerd_paths).
DROP_IN = f"{PREFIX}/containerd/config.d/kata-deploy.toml"
COMMIT = "0000000000000000000000000000000000000000"


@dataclass(frozen=True)
class KataInstall:
    """A profile's ``kata``: who installed Kata, its release, which shims."""

    installed_by: str = "kata-deploy"
    release: str = "3.29.0"
    shims: tuple[str, ...] = (GO,)


def shim_names(install: KataInstall) -> list[tuple[str, str]]:
    """(kata-deploy shim name, flavour) for each GPU shim of the install."""
    out = []
    for flavour in install.shims:
        suffix = "-runtime-rs" if flavour == RUST else ""
        out += [(shim + suffix, flavour) for shim in GPU_SHIMS]
    return out


def shim_path(flavour: str) -> str:
    return f"{PREFIX}/runtime-rs/bin/containerd-shim-kata-v2" if flavour == RUST else \
        f"{PREFIX}/bin/containerd-shim-kata-v2"


def config_dir(flavour: str) -> str:
    base = f"{PREFIX}/share/defaults/kata-containers"
    return f"{base}/runtime-rs" if flavour == RUST else base


def runtime_config(shim: str, flavour: str) -> str:
    """The ConfigPath kata-deploy registers for ``shim``."""
    return f"{config_dir(flavour)}/runtimes/{shim}/configuration-{shim}.toml"


def version_line(release: str, flavour: str) -> str:
    if flavour == RUST:
        return f"Kata Containers containerd shim (Rust): id: io.containerd.kata.v2, version: {release}, commit: {COMMIT}"
    return (f'Kata Containers containerd shim (Golang): id: "io.containerd.kata.v2", version: {release}, '
            f"commit: {COMMIT}")


def _write(host: HostRoot, host_path: str, text: str, mode: int = 0o644) -> None:
    local = host.path(host_path)
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_text(text)
    os.chmod(local, mode)


def _uses_conf_d(install: KataInstall) -> bool:
    """Kata 4.x nodes run containerd 2.2+ here (config version 3, conf.d imported)."""
    return int(install.release.split(".")[0]) >= 4


# The CRI plugin kata-deploy writes its runtimes under, by the main config's version
# (runtime/containerd.rs get_containerd_pluginid: 3 and later the split CRI runtime plugin).
V2_PLUGIN, V3_PLUGIN = '"io.containerd.grpc.v1.cri"', '"io.containerd.cri.v1.runtime"'


def install_files(host: HostRoot, install: KataInstall, *, shim: Path | None = None) -> list[str]:
    """kata-deploy's files under /opt/kata (the release's VERSION, each flavour's shim, each GPU
    shim's shipped config and the copy containerd names, with its config.d); ``shim``: a binary
    to install as each flavour's shim (the real node's stand-in, hack/containerd/kata-shim, which
    answers --version as the flavour it is installed as), else the shell stand-ins. Returns the
    host paths written."""
    written = [f"{PREFIX}/VERSION"]
    _write(host, written[0], install.release + "\n")
    for flavour in install.shims:
        if shim is not None:
            local = host.path(shim_path(flavour))
            local.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shim, local)
            os.chmod(local, 0o755)
        else:
            script = ('#!/bin/sh\n# A stand-in for Kata\'s containerd-shim-kata-v2 (nodesim.katadeploy).\n'
                      'if [ "$1" = "--version" ]; then\n'
                      f"  echo '{version_line(install.release, flavour)}'\n"
                      "  exit 0\nfi\necho 'a stand-in shim: only --version' >&2\nexit 1\n")
            _write(host, shim_path(flavour), script, 0o755)
        written.append(shim_path(flavour))
    for shim_name, flavour in shim_names(install):
        shipped = f"{config_dir(flavour)}/configuration-{shim_name}.toml"
        body = (f"# A stand-in of Kata {install.release}'s configuration-{shim_name}.toml (nodesim.katadeploy).\n"
                '[hypervisor.qemu]\npath = "/opt/kata/bin/qemu-system-x86_64"\n'
                'cold_plug_vfio = "root-port"\n\n[runtime]\ninternetworking_model = "tcfilter"\n')
        _write(host, shipped, body)
        _write(host, runtime_config(shim_name, flavour), body)
        host.path(runtime_config(shim_name, flavour)).parent.joinpath("config.d").mkdir(exist_ok=True)
        written += [shipped, runtime_config(shim_name, flavour)]
    return written


def drop_in(install: KataInstall, plugin: str, prefix: str = "") -> str:
    """kata-deploy's containerd drop-in: one runtime per GPU shim (runtime/containerd.rs
    write_containerd_runtime_config). ``prefix``: kata-deploy's INSTALLATION_PREFIX (config.rs:
    the install dir is ``<prefix>/opt/kata``), which every path it writes carries."""
    entries = []
    for shim, flavour in shim_names(install):
        table = f"plugins.{plugin}.containerd.runtimes.kata-{shim}"
        entries.append(f'[{table}]\nruntime_type = "io.containerd.kata-{shim}.v2"\n'
                       f'runtime_path = "{prefix}{shim_path(flavour)}"\nprivileged_without_host_devices = true\n'
                       f'pod_annotations = ["io.katacontainers.*"]\n'
                       f'container_annotations = ["io.kubernetes.container.terminationMessage*"]\n\n'
                       f'[{table}.options]\nConfigPath = "{prefix}{runtime_config(shim, flavour)}"\n')
    return "\n".join(entries)


def with_import(main: str, path: str) -> str:
    """containerd's main config ``main`` with ``path`` added to its top-level ``imports``, as
    kata-deploy appends its drop-in there (runtime/containerd.rs configure_containerd,
    toml::append_to_toml_array ``.imports``); made after ``version`` where there is none."""
    have = tomllib.loads(main).get("imports", [])
    if path in have:
        return main
    line = f"imports = {json.dumps([*have, path])}"
    lines = main.splitlines()
    at = next((i for i, text in enumerate(lines) if text.strip().startswith("imports")), None)
    if at is not None and have:
        lines[at] = line  # kata-deploy's own imports are one line; a multi-line array is not ours
    else:
        version = next((i for i, text in enumerate(lines) if text.strip().startswith("version")), -1)
        lines.insert(version + 1, line)
    return "\n".join(lines) + "\n"


def lay_out(host: HostRoot, install: KataInstall) -> None:
    """Write kata-deploy's files for ``install`` into ``host`` (containerd's main config too)."""
    install_files(host, install)
    conf_d = _uses_conf_d(install)
    text = drop_in(install, V3_PLUGIN if conf_d else V2_PLUGIN)
    if conf_d:
        drop_in_path = "/etc/containerd/conf.d/kata-deploy.toml"
        main = 'version = 3\nimports = ["/etc/containerd/conf.d/*.toml"]\n'
    else:
        drop_in_path = DROP_IN
        main = f'version = 2\nimports = ["{drop_in_path}"]\n'
    _write(host, drop_in_path, text)
    plugin = V3_PLUGIN if conf_d else V2_PLUGIN
    main += (f'\n[plugins.{plugin}.containerd.runtimes.runc]\nruntime_type = "io.containerd.runc.v2"\n')
    _write(host, "/etc/containerd/config.toml", main)
