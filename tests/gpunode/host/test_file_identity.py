"""Files we edit keep their identity: mode, owner, group, xattrs, and symlinks stay links.

A containerd config that holds registry credentials is often 0600; an SELinux host
labels it; some distributions make /etc/containerd/config.toml a symlink into a
managed tree. apply edits it, revert restores it, and through both the file stays
the operator's: never more readable, never re-owned, never replaced by a copy.
"""

from __future__ import annotations

import os
import shutil
import stat

import pytest
from support.hostkit import GPU_A10, dev, make_host
from support.kataconfig import kata_manager_yaml
from support.paths import REPO

from gpunode.host.files import write_atomic
from gpunode.host.pciids import PciIds
from gpunode.policy.naming import Naming
from katamgr.config import parse_config
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.reconcile import Steps, reconcile, revert_all

DATA = REPO / "katamgr" / "data"
ORIGINAL = (DATA / "demo" / "containerd-config.toml").read_bytes()
NAMING = Naming(PciIds.find())
CTX = KataContext(parse_config(kata_manager_yaml()))
XATTRS = {"user.katamgr-test": b"tagged", "security.selinux": b"system_u:object_r:container_config_t:s0\x00"}


def node(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4)])
    shutil.copytree(DATA / "oci-layout", host.path("/opt/kata-artifacts/layout"))
    host.path("/etc/containerd").mkdir(parents=True)
    return host


def identity(path) -> tuple:
    st = os.stat(path)
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, {n: os.getxattr(path, n) for n in sorted(os.listxattr(path))}


def test_apply_and_revert_keep_mode_owner_group_and_xattrs(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("this test chowns a file to another user: run it as root, as CI does")
    host = node(tmp_path)
    config = host.path("/etc/containerd/config.toml")
    config.write_bytes(ORIGINAL)
    os.chown(config, 1234, 2345)
    os.chmod(config, 0o600)
    for name, value in XATTRS.items():
        os.setxattr(config, name, value)
    before = identity(config)

    assert reconcile(host, NAMING, Steps(), CTX).ok
    assert config.read_bytes() != ORIGINAL  # our runtimes went in
    assert identity(config) == before

    revert_all(host, Steps(), CTX)
    assert config.read_bytes() == ORIGINAL
    assert identity(config) == before


def test_a_symlinked_config_is_edited_through_the_link(tmp_path):
    host = node(tmp_path)
    managed = host.path("/etc/managed/containerd.toml")
    managed.parent.mkdir(parents=True)
    managed.write_bytes(ORIGINAL)
    os.chmod(managed, 0o640)
    link = host.path("/etc/containerd/config.toml")
    os.symlink("../managed/containerd.toml", link)

    assert reconcile(host, NAMING, Steps(), CTX).ok
    assert link.is_symlink() and os.readlink(link) == "../managed/containerd.toml"
    assert b"kata-qemu-nvidia-gpu" in managed.read_bytes()
    assert stat.S_IMODE(os.stat(managed).st_mode) == 0o640

    revert_all(host, Steps(), CTX)
    assert link.is_symlink() and managed.read_bytes() == ORIGINAL


def test_new_files_get_the_asked_mode_and_existing_ones_never_widen(tmp_path):
    fresh = tmp_path / "state.json"
    write_atomic(fresh, "{}", mode=0o600)
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o600
    os.chmod(fresh, 0o400)
    write_atomic(fresh, "{ }", mode=0o644)
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o400
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temp file left
