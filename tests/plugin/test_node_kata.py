"""The device plugin and the DRA driver learn the node's Kata release as katamgr does
(``katadetect.on_node``, through the node's context, ``gpunode.services.nodecontext``) where
--kata-version gives none: on a node where kata-deploy installed Kata 4.1 (whose shims
cold-plug NVSwitches), the NVSwitches katamgr bound to vfio-pci are advertised without a typed
release; on 3.29 katamgr keeps them on the host and nothing advertises them."""

from __future__ import annotations

import dataclasses

import pytest
from support.nodecontextkit import katamgr_context, plugin_context

from katamgr.pipeline.reconcile import Steps, reconcile
from nodesim.katadeploy import KataInstall
from nodesim.materialise import materialise
from nodesim.profiles import find_profile
from sandbox_plugin import cli as plugin_cli
from sandbox_plugin.dra import cli as dra_cli
from sandbox_plugin.units import scan_units

NVSWITCHES = {"0000:05:00.0", "0000:15:00.0", "0000:85:00.0", "0000:95:00.0"}  # dgx-h100's


def _node(tmp_path, release: str):
    profile = dataclasses.replace(find_profile("dgx-h100"), kata=KataInstall("kata-deploy", release, ("go",)))
    host = materialise(profile, tmp_path / "root")
    # katamgr binds what the release found lets it (NVSwitches on 4.1 and later).
    naming = katamgr_context(host).naming
    assert reconcile(host, naming, Steps(kata=False, cdi=False), None).ok
    return host


def _advertised_nvswitches(host, *extra: str) -> set[str]:
    naming = plugin_context(host, *extra).naming
    return {d.bdf for unit in scan_units(host, naming) for d in unit.devices if d.bdf in NVSWITCHES}


@pytest.mark.parametrize(("release", "advertised"), [("3.29.0", False), ("4.1.0", True)])
def test_the_plugin_advertises_the_nvswitches_the_release_found_lets_through(tmp_path, release, advertised):
    host = _node(tmp_path, release)
    assert _advertised_nvswitches(host) == (NVSWITCHES if advertised else set())


def test_a_typed_release_stays_the_plugin_s_override(tmp_path):
    host = _node(tmp_path, "4.1.0")
    assert _advertised_nvswitches(host, "--kata-version", "3.29.0") == set()


def test_containerd_s_config_is_a_host_path_for_both_programs(tmp_path, capsys):
    host = _node(tmp_path, "4.1.0")
    # Elsewhere (no Kata runtime in that config) the release is unknown: none advertised.
    assert _advertised_nvswitches(host, "--containerd-config", "/etc/elsewhere.toml") == set()
    with pytest.raises(SystemExit) as refused:  # usage: exit 2, as every path option of the three
        plugin_cli.parse_args(["--host-root", str(host.root), "--containerd-config", "etc/x.toml"])
    assert refused.value.code == 2
    assert "--containerd-config: 'etc/x.toml' is not an absolute path" in capsys.readouterr().err
    args = dra_cli.build_parser().parse_args(["--node-name", "n"])
    assert args.containerd_config == "/etc/containerd/config.toml"
    with pytest.raises(SystemExit) as refused:
        dra_cli.main(["--node-name", "n", "--host-root", str(host.root), "--containerd-config", "x.toml"])
    assert refused.value.code == 2
    assert "--containerd-config: 'x.toml' is not an absolute path" in capsys.readouterr().err
