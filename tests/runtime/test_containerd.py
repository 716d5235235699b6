"""containerd config edits: checked by the real containerd (1.6) where it can read them.

containerd 1.6 parses every version-2 file we write (`containerd --config F config
dump`). It predates CDI support in CRI and drops `enable_cdi`/`cdi_spec_dirs` from
its dump, so those keys are checked in the file itself. Version 3 files are checked
structurally against containerd 2.x's documented default config.
"""


from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from support.containerdconfigs import (
    CONFIG,
    DATA,
    GPU,
    HAND_WRITTEN,
    SNP,
    V2_CRI,
    V3_CRI,
    assert_cdi,
    assert_kata,
    containerd_default,
    cri,
    dump,
    put,
    without,
)

from gpunode.errors import ConfigError
from gpunode.host import root as root_module
from gpunode.host.root import HostRoot
from katamgr.runtime.containerd import configure_containerd
from katamgr.runtime.containerd_files import KataRuntime
from katamgr.runtime.containerd_imports import DROP_IN_NAME
from katamgr.runtime.containerd_revert import check_entries, revert_containerd
from katamgr.runtime.reload import CommandResult, reload_containerd


@pytest.mark.integration
def test_containerd_default_config_gets_runtimes_and_cdi(host: HostRoot) -> None:
    original = containerd_default()
    local = put(host, original)
    before = dump(local)

    change = configure_containerd(host, [GPU, SNP])

    assert change.changed and change.needs_reload and change.mode == "main"
    assert change.runtimes_added == (GPU.name, SNP.name)
    assert f'+        [plugins."{V2_CRI}".containerd.runtimes.{GPU.name}]' in change.diff
    after = dump(local)
    assert_kata(after, GPU)
    assert_kata(after, SNP)
    assert_cdi(tomllib.loads(local.read_text()))
    # Nothing else moved: containerd reads every other value as before.
    assert without(after, [GPU.name, SNP.name]) == before
    assert cri(after)["containerd"]["default_runtime_name"] == "runc"


@pytest.mark.integration
def test_hand_written_config_keeps_comments_default_runtime_and_other_runtimes(
    host: HostRoot,
) -> None:
    local = put(host, HAND_WRITTEN)
    before = dump(local)

    configure_containerd(host, [GPU])

    text = local.read_text()
    for line in HAND_WRITTEN.splitlines():
        assert line in text.splitlines(), f"lost line: {line!r}"
    after = dump(local)
    assert_kata(after, GPU)
    assert_cdi(tomllib.loads(text))
    assert cri(after)["containerd"]["default_runtime_name"] == "crun"
    assert without(after, [GPU.name]) == before


@pytest.mark.integration
def test_applying_twice_writes_once_and_asks_for_one_restart(host: HostRoot) -> None:
    local = put(host, containerd_default())
    restarts: list[list[str]] = []

    def runner(argv):
        restarts.append(list(argv))
        return CommandResult(0, "")

    changes = []
    for _ in range(2):
        change = configure_containerd(host, [GPU])
        changes.append(change)
        if change.needs_reload:
            reload_containerd(host, "systemd", runner=runner)
        if len(changes) == 1:
            first = local.stat()

    second = local.stat()
    assert [c.changed for c in changes] == [True, False]
    assert changes[1].diff == "" and changes[1].runtimes_added == ()
    assert (second.st_ino, second.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    assert restarts == [["chroot", str(host.root), "systemctl", "restart", "containerd"]]


@pytest.mark.integration
@pytest.mark.parametrize("source", ["default", "hand-written"])
def test_revert_restores_the_original_bytes(host: HostRoot, source: str) -> None:
    original = containerd_default() if source == "default" else HAND_WRITTEN
    local = put(host, original)
    configure_containerd(host, [GPU, SNP])
    configure_containerd(host, [GPU])  # a second change of ours on top of the first

    change = revert_containerd(host)

    assert change.changed and change.runtimes_removed == (GPU.name,)
    assert local.read_text() == original
    assert revert_containerd(host).changed is False  # nothing left to undo


@pytest.mark.integration
def test_revert_after_someone_else_edited_keeps_their_edit(host: HostRoot) -> None:
    local = put(host, HAND_WRITTEN)
    configure_containerd(host, [GPU, SNP])
    theirs = local.read_text().replace(
        'sandbox_image = "registry.example.com/pause:3.9"',
        'sandbox_image = "registry.example.com/pause:3.10"',
    )
    theirs += (
        '\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.gvisor]\n'
        '  runtime_type = "io.containerd.runsc.v1"\n'
    )
    local.write_text(theirs)

    change = revert_containerd(host)

    assert change.changed and set(change.runtimes_removed) == {GPU.name, SNP.name}
    text = local.read_text()
    parsed = dump(local)
    runtimes = cri(parsed)["containerd"]["runtimes"]
    assert set(runtimes) == {"crun", "runc", "gvisor"}
    assert cri(parsed)["sandbox_image"] == "registry.example.com/pause:3.10"
    assert cri(parsed)["containerd"]["default_runtime_name"] == "crun"
    written = tomllib.loads(text)
    assert "enable_cdi" not in cri(written) and "cdi_spec_dirs" not in cri(written)
    assert "# crun is our default; do not change without a ticket" in text


def test_revert_restores_values_we_changed_and_keeps_values_others_changed(
    host: HostRoot,
) -> None:
    original = HAND_WRITTEN.replace(
        '    sandbox_image = "registry.example.com/pause:3.9"  # mirrored\n',
        '    sandbox_image = "registry.example.com/pause:3.9"  # mirrored\n'
        "    enable_cdi = false\n"
        '    cdi_spec_dirs = ["/opt/cdi"]\n',
    )
    local = put(host, original)
    configure_containerd(host, [GPU])
    written = tomllib.loads(local.read_text())
    assert cri(written)["enable_cdi"] is True
    assert cri(written)["cdi_spec_dirs"] == ["/opt/cdi", "/etc/cdi", "/var/run/cdi"]
    # Someone else edits the file and also picks their own CDI dirs.
    local.write_text(
        local.read_text().replace(
            'cdi_spec_dirs = ["/opt/cdi", "/etc/cdi", "/var/run/cdi"]',
            'cdi_spec_dirs = ["/srv/cdi"]',
        )
    )

    revert_containerd(host)

    reverted = tomllib.loads(local.read_text())
    assert cri(reverted)["enable_cdi"] is False  # ours: back to what it was
    assert cri(reverted)["cdi_spec_dirs"] == ["/srv/cdi"]  # theirs: kept
    assert GPU.name not in cri(reverted)["containerd"]["runtimes"]


def test_dropping_a_runtime_class_removes_only_that_entry(host: HostRoot) -> None:
    local = put(host, HAND_WRITTEN)
    configure_containerd(host, [GPU, SNP])

    change = configure_containerd(host, [GPU])

    assert change.changed and change.runtimes_removed == (SNP.name,)
    runtimes = cri(tomllib.loads(local.read_text()))["containerd"]["runtimes"]
    assert set(runtimes) == {"crun", "runc", GPU.name}
    revert_containerd(host)
    assert local.read_text() == HAND_WRITTEN


def test_an_existing_entry_of_the_same_name_is_updated_and_restored(host: HostRoot) -> None:
    original = HAND_WRITTEN + (
        '\n      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kata-qemu-nvidia-gpu]\n'
        '        runtime_type = "io.containerd.kata.v2"\n'
        '        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kata-qemu-nvidia-gpu.options]\n'
        '          ConfigPath = "/opt/kata/share/defaults/kata-containers/configuration.toml"\n'
    )
    local = put(host, original)

    change = configure_containerd(host, [GPU])

    assert change.runtimes_updated == (GPU.name,) and change.runtimes_added == ()
    assert_kata(tomllib.loads(local.read_text()), GPU)
    local.write_text(local.read_text() + "\n# touched by someone else\n")
    revert_containerd(host)
    entry = cri(tomllib.loads(local.read_text()))["containerd"]["runtimes"][GPU.name]
    assert entry == {
        "runtime_type": "io.containerd.kata.v2",
        "options": {"ConfigPath": "/opt/kata/share/defaults/kata-containers/configuration.toml"},
    }


@pytest.mark.integration
def test_missing_config_is_started_as_version_2_and_removed_on_revert(host: HostRoot) -> None:
    change = configure_containerd(host, [GPU])

    local = host.path(CONFIG)
    assert change.changed and change.version == 2
    assert local.read_text().startswith("version = 2\n")
    assert_kata(dump(local), GPU)
    assert_cdi(tomllib.loads(local.read_text()))
    revert_containerd(host)
    assert not local.exists()


def test_config_without_version_is_refused(host: HostRoot) -> None:
    local = put(host, '[plugins.cri]\n  sandbox_image = "pause:3.9"\n')
    with pytest.raises(ConfigError, match="no 'version' key"):
        configure_containerd(host, [GPU])
    assert local.read_text() == '[plugins.cri]\n  sandbox_image = "pause:3.9"\n'


def test_forced_version_must_match_the_file(host: HostRoot) -> None:
    put(host, HAND_WRITTEN)
    with pytest.raises(ConfigError, match="version 2 but version 3 was requested"):
        configure_containerd(host, [GPU], version=3)


def test_forced_version_3_starts_a_version_3_file(host: HostRoot) -> None:
    change = configure_containerd(host, [GPU], version=3)
    parsed = tomllib.loads(host.path(CONFIG).read_text())
    assert change.version == 3 and parsed["version"] == 3
    assert_kata(parsed, GPU, V3_CRI)
    assert_cdi(parsed, V3_CRI)


def test_bad_runtime_names_are_refused(host: HostRoot) -> None:
    with pytest.raises(ConfigError, match="not a valid RuntimeClass handler"):
        configure_containerd(host, [KataRuntime("Kata_GPU", GPU.config_path)])
    with pytest.raises(ConfigError, match="not absolute"):
        configure_containerd(host, [KataRuntime("kata", "configuration.toml")])
    assert not host.path(CONFIG).exists()


@pytest.mark.integration
def test_drop_in_through_imports_leaves_main_file_and_keeps_cri_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real containerd follows the absolute import glob, so host paths must be
    # real paths here: host root "/", config and drop-ins under tmp_path, and our
    # revert state kept under tmp_path too.
    monkeypatch.setattr(root_module, "STATE_DIR", str(tmp_path / "state"))
    host = HostRoot.at("/")
    config = str(tmp_path / "etc/containerd/config.toml")
    conf_d = str(tmp_path / "etc/containerd/conf.d")
    main = HAND_WRITTEN.replace(
        'root = "/var/lib/containerd"\n',
        f'root = "/var/lib/containerd"\nimports = ["{conf_d}/*.toml"]\n',
    )
    local = put(host, main, config)
    put(
        host,
        "# someone else's drop-in without CRI settings\nversion = 2\n",
        f"{conf_d}/00-other.toml",
    )
    before = dump(local)

    change = configure_containerd(host, [GPU], config_path=config)

    drop_in = Path(conf_d) / DROP_IN_NAME
    assert change.mode == "drop-in" and change.path == str(drop_in)
    assert local.read_text() == main
    after = dump(local)
    assert_kata(after, GPU)
    assert_cdi(tomllib.loads(drop_in.read_text()))
    # containerd 1.x takes a plugin section whole from the last file naming it: the
    # operator's CRI settings must come through the drop-in unchanged.
    assert cri(after)["sandbox_image"] == "registry.example.com/pause:3.9"
    assert cri(after)["containerd"]["default_runtime_name"] == "crun"
    assert without(after, [GPU.name])["plugins"] == before["plugins"]
    assert check_entries(host, config, [GPU]) == []

    assert configure_containerd(host, [GPU], config_path=config).changed is False
    revert_containerd(host, config)
    assert not drop_in.exists() and local.read_text() == main
    assert not (tmp_path / "state" / "containerd").exists() or not any(
        (tmp_path / "state" / "containerd").iterdir()
    )


def test_drop_in_for_the_containerd2_default_imports(host: HostRoot) -> None:
    main = (
        (DATA / "containerd2-default.toml")
        .read_text()
        .replace("version = 3\n", "version = 3\nimports = ['/etc/containerd/conf.d/*.toml']\n")
    )
    local = put(host, main)

    change = configure_containerd(host, [GPU])

    assert change.mode == "drop-in" and local.read_text() == main
    drop_in = tomllib.loads(host.path(change.path).read_text())
    assert drop_in["version"] == 3
    # containerd 2.x merges plugin sections key by key: our file holds only our part.
    assert set(cri(drop_in, V3_CRI)) == {"containerd", "enable_cdi", "cdi_spec_dirs"}
    assert set(cri(drop_in, V3_CRI)["containerd"]["runtimes"]) == {GPU.name}
    assert_kata(drop_in, GPU, V3_CRI)


def test_containerd2_documented_default_gets_entries_where_2x_keeps_them(
    host: HostRoot,
) -> None:
    original = (DATA / "containerd2-default.toml").read_text()
    local = put(host, original)

    change = configure_containerd(host, [GPU, SNP])

    assert change.version == 3 and change.changed
    parsed = tomllib.loads(local.read_text())
    reference = tomllib.loads(original)
    runtimes = cri(parsed, V3_CRI)["containerd"]["runtimes"]
    assert set(runtimes) == {"runc", GPU.name, SNP.name}
    assert_kata(parsed, GPU, V3_CRI)
    assert_kata(parsed, SNP, V3_CRI)
    assert_cdi(parsed, V3_CRI)
    assert runtimes["runc"] == cri(reference, V3_CRI)["containerd"]["runtimes"]["runc"]
    assert "containerd" not in cri(parsed, V2_CRI)  # nothing under the 1.x plugin name
    assert cri(parsed, V3_CRI)["containerd"]["default_runtime_name"] == "runc"
    # Only additions: every original line (single-quoted values included) is intact.
    assert not [
        line
        for line in change.diff.splitlines()
        if line.startswith("-") and not line.startswith("---")
    ]
    revert_containerd(host)
    assert local.read_text() == original


def test_check_entries_sees_dropped_or_altered_entries(host: HostRoot) -> None:
    local = put(host, HAND_WRITTEN)
    configure_containerd(host, [GPU, SNP])
    assert check_entries(host, CONFIG, [GPU, SNP]) == []

    # Someone restores their own copy of the config (our entries vanish) ...
    text = local.read_text()
    start = text.index(f'[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{SNP.name}]')
    local.write_text(text[:start])
    assert check_entries(host, CONFIG, [GPU, SNP]) == [SNP.name]
    # ... or points ours elsewhere.
    moved = KataRuntime(GPU.name, "/opt/elsewhere/configuration.toml")
    assert check_entries(host, CONFIG, [moved]) == [GPU.name]

    # The next apply puts it back (and a restart is due).
    assert configure_containerd(host, [GPU, SNP]).needs_reload
    assert check_entries(host, CONFIG, [GPU, SNP]) == []


def test_relative_imports_do_not_move_us_to_a_drop_in(host: HostRoot) -> None:
    # containerd 1.6 resolves relative imports against its working directory, which
    # we cannot see: keep editing the main file.
    main = HAND_WRITTEN.replace("version = 2\n", 'version = 2\nimports = ["conf.d/*.toml"]\n')
    local = put(host, main)
    change = configure_containerd(host, [GPU])
    assert change.mode == "main" and change.path == CONFIG
    assert_kata(tomllib.loads(local.read_text()), GPU)
    assert not host.path("/etc/containerd/conf.d").exists()
