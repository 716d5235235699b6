"""containerd config edits cut short: a crash before or after each write of the main file
or our drop-in never loses the operator's original, and a revert after it restores it
(or keeps someone else's later edit); a dry run writes nothing."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from support.containerdconfigs import CONFIG, GPU, HAND_WRITTEN, SNP, assert_kata, cri, dump, put

import katamgr.runtime.containerd as containerd_module
from gpunode.host.root import HostRoot
from katamgr.runtime.containerd import configure_containerd
from katamgr.runtime.containerd_imports import DROP_IN_NAME
from katamgr.runtime.containerd_revert import revert_containerd


class Crash(Exception):
    """Stands for the process dying at the injected point."""


def crash_once(monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """Make the next config write die before it lands, or right after it landed
    (before anything else of ours ran)."""
    real = containerd_module.write_atomic
    armed = [True]

    def faulty(path, data, mode=0o644):
        if not armed[0]:
            return real(path, data, mode)
        armed[0] = False
        if when == "after-write":
            real(path, data, mode)
        raise Crash(f"died {when} of {path}")

    monkeypatch.setattr(containerd_module, "write_atomic", faulty)


def host_files(host: HostRoot) -> dict[str, tuple[bytes, int]]:
    """Every file under the host root (config and our state alike) with its mtime."""
    return {
        str(p.relative_to(host.root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(Path(host.root).rglob("*"))
        if p.is_file()
    }


@pytest.mark.integration
@pytest.mark.parametrize("then", ["configure", "revert"])
@pytest.mark.parametrize("step", ["first change", "dropping a runtime"])
@pytest.mark.parametrize("when", ["before-write", "after-write"])
def test_crash_around_the_config_write_never_loses_the_original(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, when: str, step: str, then: str
) -> None:
    local = put(host, HAND_WRITTEN)
    if step == "dropping a runtime":
        configure_containerd(host, [GPU, SNP])
    crash_once(monkeypatch, when)

    with pytest.raises(Crash):
        configure_containerd(host, [GPU])

    if then == "configure":
        # The next run converges: exactly GPU of ours, as containerd reads it.
        configure_containerd(host, [GPU])
        after = dump(local)
        assert_kata(after, GPU)
        assert set(cri(after)["containerd"]["runtimes"]) == {"crun", "runc", GPU.name}
        assert configure_containerd(host, [GPU]).changed is False
    change = revert_containerd(host)

    assert local.read_bytes() == HAND_WRITTEN.encode()
    assert change.changed is (then == "configure" or when == "after-write" or step != "first change")
    assert not host.state_path("containerd").exists() or not any(
        host.state_path("containerd").iterdir()
    )


@pytest.mark.parametrize("when", ["before-write", "after-write"])
def test_crash_while_creating_a_missing_config_leaves_nothing_after_revert(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    crash_once(monkeypatch, when)
    with pytest.raises(Crash):
        configure_containerd(host, [GPU])

    assert configure_containerd(host, [GPU]).changed is (when == "before-write")
    assert_kata(tomllib.loads(host.path(CONFIG).read_text()), GPU)
    revert_containerd(host)
    assert not host.path(CONFIG).exists()


def test_someone_elses_edit_after_a_crash_is_kept_on_revert(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = put(host, HAND_WRITTEN)
    configure_containerd(host, [GPU, SNP])
    crash_once(monkeypatch, "before-write")
    with pytest.raises(Crash):
        configure_containerd(host, [GPU])
    # The file matches neither side of the interrupted write: someone else's edit.
    local.write_text(local.read_text().replace("pause:3.9", "pause:3.10"))

    configure_containerd(host, [GPU])
    revert_containerd(host)

    # A surgical revert: their edit stays, every trace of ours (SNP included) goes.
    reverted = local.read_text()
    assert 'sandbox_image = "registry.example.com/pause:3.10"  # mirrored' in reverted
    assert tomllib.loads(reverted) == tomllib.loads(HAND_WRITTEN.replace("3.9", "3.10"))


DROP_IN_MAIN = HAND_WRITTEN.replace(
    'root = "/var/lib/containerd"\n',
    'root = "/var/lib/containerd"\nimports = ["/etc/containerd/conf.d/*.toml"]\n',
)
DROP_IN = f"/etc/containerd/conf.d/{DROP_IN_NAME}"


@pytest.mark.parametrize("then", ["configure", "revert"])
@pytest.mark.parametrize(
    "existing", [None, "# an older file of this name\nversion = 2\n"], ids=["new", "older-file"]
)
@pytest.mark.parametrize("when", ["before-write", "after-write"])
def test_crash_around_the_drop_in_write_never_loses_the_original(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, when: str, existing: str | None, then: str
) -> None:
    main = put(host, DROP_IN_MAIN)
    if existing is not None:
        put(host, existing, DROP_IN)
    configure_containerd(host, [GPU, SNP])
    crash_once(monkeypatch, when)

    with pytest.raises(Crash):
        configure_containerd(host, [GPU])

    drop_in = host.path(DROP_IN)
    if then == "configure":
        change = configure_containerd(host, [GPU])
        assert change.mode == "drop-in"
        runtimes = cri(tomllib.loads(drop_in.read_text()))["containerd"]["runtimes"]
        assert set(runtimes) == {"crun", "runc", GPU.name}
    revert_containerd(host)

    assert main.read_text() == DROP_IN_MAIN
    if existing is None:
        assert not drop_in.exists()
    else:
        assert drop_in.read_text() == existing


@pytest.mark.parametrize(
    "setup",
    ["missing", "hand-written", "configured", "configured, then changed", "drop-in"],
)
def test_dry_run_writes_nothing(host: HostRoot, setup: str) -> None:
    if setup == "drop-in":
        put(host, DROP_IN_MAIN)
    elif setup != "missing":
        put(host, HAND_WRITTEN)
    if setup.startswith("configured") or setup == "drop-in":
        configure_containerd(host, [GPU, SNP])
    wanted = [GPU] if setup in ("configured, then changed", "drop-in") else [GPU, SNP]
    before = host_files(host)

    change = configure_containerd(host, wanted, dry_run=True)

    assert host_files(host) == before
    assert change.changed is (setup != "configured")
    assert (change.diff != "") is change.changed
    if setup in ("configured, then changed", "drop-in"):
        assert change.runtimes_removed == (SNP.name,)
