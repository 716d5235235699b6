"""Only what is ours is replaced or removed: artifacts dirs that katamgr did not install stay.

With ``artifactsDir: /opt`` and a runtime class named ``kata``, the class's dir is
``/opt/kata``: where kata-deploy keeps its shim. Such a dir is refused, named with
the config key to change, and left byte for byte as it was, by apply and revert.
A crash part-way through removing an install leaves nothing a later run cannot finish.
"""

from __future__ import annotations

import os
import shutil

import pytest
from support.hostkit import GPU_A10, dev, driver_of, make_host
from support.kataconfig import kata_manager_yaml
from support.paths import EXAMPLES

from gpunode.errors import ConfigError
from gpunode.host.pciids import PciIds
from gpunode.policy.naming import Naming
from katamgr.artifacts import NotOursError, install_artifact, read_install, remove_install
from katamgr.config import parse_config
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.reconcile import Steps, reconcile, revert_all

LAYOUT = EXAMPLES / "oci-layout"
NAMING = Naming(PciIds.find())


def tree(path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def config(artifacts_dir: str, name: str):
    return KataContext(parse_config(kata_manager_yaml(
        (name,), artifacts_dir=artifacts_dir, url="oci-layout:///layout:kata-qemu-nvidia-gpu")))


@pytest.mark.parametrize("artifacts_dir, name, foreign", [
    ("/opt", "kata", {"bin/containerd-shim-kata-v2": b"\x7fELF shim", "share/defaults/kata.toml": b"x=1\n"}),
    # (katamgr's own edit of /etc/containerd/config.toml is the containerd step, not this.)
    ("/etc", "containerd", {"certs.d/registry.example/hosts.toml": b'server = "https://r"\n'}),
])
def test_a_dir_someone_else_filled_is_refused_and_left_alone(tmp_path, artifacts_dir, name, foreign):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4)])
    shutil.copytree(LAYOUT, host.path("/layout"))
    theirs = host.path(f"{artifacts_dir}/{name}")
    for rel, data in foreign.items():
        (theirs / rel).parent.mkdir(parents=True, exist_ok=True)
        (theirs / rel).write_bytes(data)
    before = tree(theirs)
    siblings = sorted(p.name for p in theirs.parent.iterdir())
    ctx = config(artifacts_dir, name)

    # Found before the first write: bad configuration, exit 2, nothing changed at all.
    with pytest.raises(ConfigError) as refused:
        reconcile(host, NAMING, Steps(), ctx)
    failure = str(refused.value)
    assert f"{artifacts_dir}/{name}" in failure and "kataManager.config.artifactsDir" in failure
    assert "nothing was changed" in failure
    assert driver_of(host, "0000:01:00.0") == "nvidia"
    assert tree(theirs) == before
    # Not even our lock file appears beside it.
    assert sorted(p.name for p in theirs.parent.iterdir()) == siblings

    revert_all(host, Steps(), ctx)
    assert {k: v for k, v in tree(theirs).items() if k in before} == before


def test_install_refuses_files_symlinks_and_foreign_dirs_but_takes_an_empty_dir(tmp_path):
    url = f"oci-layout://{LAYOUT}:kata-qemu-nvidia-gpu"
    (tmp_path / "file").write_text("mine")
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    for name in ("file", "link", "full"):
        with pytest.raises(NotOursError, match=str(tmp_path / name)):
            install_artifact(url, tmp_path / name)
    assert (tmp_path / "file").read_text() == "mine" and (tmp_path / "full" / "keep.txt").exists()
    (tmp_path / "empty").mkdir()
    assert install_artifact(url, tmp_path / "empty").changed


def test_an_interrupted_removal_is_finished_by_the_next_run(tmp_path, monkeypatch):
    url = f"oci-layout://{LAYOUT}:kata-qemu-nvidia-gpu"
    dest = tmp_path / "rc"
    install_artifact(url, dest)

    def crash(path, *args, **kwargs):
        raise KeyboardInterrupt  # stands in for a kill part-way through the deletion

    monkeypatch.setattr(shutil, "rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        remove_install(dest)
    monkeypatch.undo()
    # The install left its name in one step: no half-removed dir under the class's name.
    assert not dest.exists()
    leftovers = list(tmp_path.glob(".rc.removing-*"))
    assert len(leftovers) == 1 and read_install(leftovers[0]) is not None
    # The next install (or removal) clears what the crash left.
    assert install_artifact(url, dest).changed
    assert list(tmp_path.glob(".rc.removing-*")) == []
    assert remove_install(dest) and not dest.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
