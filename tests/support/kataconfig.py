"""The kataManager config and the node around it that tests of the Kata step start from.

A node as an air-gapped one is before katamgr (the demo's containerd config, the shipped
OCI layout at ``LAYOUT_ON_NODE``) and the config that pulls from that layout, written out
once here for every test area instead of in each test file.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence

from gpunode.host.root import HostRoot
from gpunode.kataclasses import GPU, GPU_SNP
from katamgr.config import DEFAULT_ARTIFACTS_DIR
from support.paths import REPO

DATA = REPO / "katamgr" / "data"
OCI_LAYOUT = DATA / "oci-layout"
DEMO_CONTAINERD = DATA / "demo" / "containerd-config.toml"
LAYOUT_ON_NODE = "/opt/kata-artifacts/layout"
SNP_SELECTOR = {"nvidia.com/cc.capable": "true"}


def kata_manager_yaml(
    classes: Sequence[str] = (GPU,),
    *,
    layout: str = LAYOUT_ON_NODE,
    artifacts_dir: str = DEFAULT_ARTIFACTS_DIR,
    restart_mode: str = "none",
    selectors: Mapping[str, Mapping[str, str]] | None = None,
    overhead: Mapping[str, str] | None = None,
    url: str | None = None,
) -> str:
    """A kataManager config (YAML) whose runtime classes pull the tag of their own name from
    the OCI layout at ``layout`` on the node (``url``: one reference for every class).
    ``selectors`` by class name; by default the SNP class keeps the GPU Operator's."""
    selectors = {GPU_SNP: SNP_SELECTOR} if selectors is None else selectors
    lines = [f"artifactsDir: {artifacts_dir}", "runtimeClasses:"]
    for name in classes:
        lines.append(f"  - name: {name}")
        if selectors.get(name):
            pairs = ", ".join(f'{k}: "{v}"' for k, v in selectors[name].items())
            lines.append(f"    nodeSelector: {{{pairs}}}")
        lines.append(f'    artifacts: {{url: "{url or f"oci-layout://{layout}:{name}"}"}}')
    if overhead:
        pairs = ", ".join(f"{k}: {v}" for k, v in overhead.items())
        lines.append(f"runtimeClassOverhead: {{podFixed: {{{pairs}}}}}")
    lines.append(f"containerd: {{restartMode: {restart_mode}}}")
    return "\n".join(lines) + "\n"


def prepare_node(host: HostRoot, *, containerd: bool = True, layout: bool = True) -> HostRoot:
    """What the node holds before katamgr: containerd's config and the artifacts' layout."""
    if containerd:
        host.path("/etc/containerd").mkdir(parents=True, exist_ok=True)
        host.path("/etc/containerd/config.toml").write_bytes(DEMO_CONTAINERD.read_bytes())
    if layout:
        shutil.copytree(OCI_LAYOUT, host.path(LAYOUT_ON_NODE))
    return host
