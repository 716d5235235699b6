"""Kata installed on the real node of tests/node the way kata-deploy installs it, and taken
off again the way its uninstall does.

What kata-deploy's installer does on a containerd node (tools/packaging/kata-deploy/binary/src
in kata-containers, facts only; nodesim.katadeploy writes the files):
- it unpacks the release under ``<INSTALLATION_PREFIX>/opt/kata`` (config.rs ``dest_dir``):
  ``VERSION``, the shims, each shim's configs;
- where containerd's main config does not import ``/etc/containerd/conf.d`` (ours does not) it
  writes its runtimes to ``<dest_dir>/containerd/config.d/kata-deploy.toml`` and appends that
  path to the main config's ``imports`` (config.rs ``get_containerd_paths``,
  runtime/containerd.rs ``configure_containerd``), under the CRI plugin the main config's
  version names (3 here: ``io.containerd.cri.v1.runtime``), then restarts containerd;
- its uninstall takes the import and the files away again and restarts containerd.

Here containerd sees the node's ``/`` at ``DIR/host`` (the chart's ``hostPaths.rootFS``), so
kata-deploy's prefix is ``DIR/host``: containerd's config names the paths containerd opens, and
the agent (``--runtime-root DIR/host``) reads them back as ``/opt/kata/...``. Two main configs
stand for the node's one: containerd's own (``DIR/containerd/config.toml``, what runs) and the
simulated host's ``/etc/containerd/config.toml`` (what the chart's agent reads; hack/localnode.py
says why they are apart); the import goes into both and names the one drop-in. The harness's
runc entries under kata-deploy's handler names leave containerd's own config while kata-deploy
is installed, so that kata-deploy's entries are the node's only ones of those names.

The shims are one stand-in (hack/containerd/kata-shim, built by
hack/containerd/build-kata-shim): containerd's runc shim taking Kata's runtime options.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gpunode.host.root import HostRoot
from nodesim import katadeploy
from support.kubecluster import LocalCluster
from support.paths import REPO

SHIM_BUILD = REPO / "hack/containerd/build-kata-shim"
# A cold build on 2 cores (containerd's packages compiled) takes minutes; after
# hack/kube/build --node, seconds.
SHIM_BUILD_TIMEOUT_S = 900
GPU_HANDLERS = tuple(f"kata-{shim}" for shim in katadeploy.GPU_SHIMS)


def shim_binary() -> Path:
    """The stand-in shim, built once into the cache (bounded; its log printed)."""
    try:
        result = subprocess.run([str(SHIM_BUILD)], capture_output=True, text=True,
                                timeout=SHIM_BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{SHIM_BUILD} took over {SHIM_BUILD_TIMEOUT_S} s: {exc.stderr}") from None
    sys.stderr.write(result.stderr)
    if result.returncode:
        raise AssertionError(f"{SHIM_BUILD} failed (exit {result.returncode}):\n{result.stderr}")
    return Path(result.stdout.strip().splitlines()[-1])


def without_runtimes(main: str, names: tuple[str, ...]) -> str:
    """hack/nodeconfig.py's containerd config less the runtime tables (and their options) of
    ``names``: each table and its indented lines."""
    pattern = "|".join(re.escape(f'"{n}"') for n in names)
    table = re.compile(rf'^\[plugins\."io\.containerd\.cri\.v1\.runtime"\.containerd\.runtimes\.({pattern})'
                       rf'(\.options)?\]\n(?:[ \t]+\S.*\n)*', re.M)
    return table.sub("", main)


def without_import(main: str, path: str) -> str:
    """``katadeploy.with_import`` undone (kata-deploy's uninstall, remove_from_toml_array)."""
    out = []
    for line in main.splitlines():
        if line.startswith("imports = ") and f'"{path}"' in line:
            rest = [p for p in re.findall(r'"([^"]*)"', line) if p != path]
            if not rest:
                continue
            line = "imports = [" + ", ".join(f'"{p}"' for p in rest) + "]"
        out.append(line)
    return "\n".join(out) + "\n"


@dataclass
class KataDeployed:
    """Kata installed on ``cluster``'s node as kata-deploy does (``install``), until ``remove``."""

    cluster: LocalCluster
    install: katadeploy.KataInstall
    prefix: str
    had: set[str] = field(default_factory=set)  # what /opt/kata held before (kept)
    installed: dict[str, str] = field(default_factory=dict)  # kata-deploy's files, as it wrote them
    containerd_main: bytes = b""

    @property
    def host(self) -> HostRoot:
        return HostRoot.at(self.cluster.host_root, runtime_root=self.prefix)

    @property
    def drop_in(self) -> str:
        """The drop-in's path as containerd (and kata-deploy's config) names it."""
        return self.prefix + katadeploy.DROP_IN

    @classmethod
    def put(cls, cluster: LocalCluster, shim: Path, install: katadeploy.KataInstall) -> KataDeployed:
        prefix = str(cluster.host_root)
        done = cls(cluster, install, prefix)
        opt = cluster.host_root / "opt/kata"
        # The chart's pods mount /opt/kata (DirectoryOrCreate): its contents change, never the dir.
        done.had = {str(p.relative_to(opt)) for p in opt.rglob("*")} if opt.is_dir() else set()
        host = done.host
        katadeploy.install_files(host, install, shim=shim)
        drop_in = host.path(katadeploy.DROP_IN)
        drop_in.parent.mkdir(parents=True, exist_ok=True)
        drop_in.write_text(katadeploy.drop_in(install, katadeploy.V3_PLUGIN, prefix))
        # Before the agent can see them: it looks once the main config imports the drop-in.
        done.installed = done.checksums()
        main = cluster.dir / "containerd/config.toml"
        done.containerd_main = main.read_bytes()
        main.write_text(katadeploy.with_import(without_runtimes(main.read_text(), GPU_HANDLERS), done.drop_in))
        agent_main = host.path("/etc/containerd/config.toml")
        agent_main.write_text(katadeploy.with_import(agent_main.read_text(), done.drop_in))
        cluster.component("restart", "containerd")
        return done

    def checksums(self) -> dict[str, str]:
        """sha256 of every file under /opt/kata that kata-deploy put there."""
        opt = self.cluster.host_root / "opt/kata"
        return {str(p.relative_to(opt)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(opt.rglob("*")) if p.is_file() and str(p.relative_to(opt)) not in self.had}

    def remove(self) -> None:
        """kata-deploy's uninstall: the import out of both main configs (containerd's own back as
        the harness wrote it), everything under /opt/kata that was not there before, containerd
        restarted."""
        (self.cluster.dir / "containerd/config.toml").write_bytes(self.containerd_main)
        agent_main = self.host.path("/etc/containerd/config.toml")
        agent_main.write_text(without_import(agent_main.read_text(), self.drop_in))
        opt = self.cluster.host_root / "opt/kata"
        for child in sorted(opt.iterdir()) if opt.is_dir() else ():
            if child.name in self.had:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        self.cluster.component("restart", "containerd")
