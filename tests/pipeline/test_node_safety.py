"""One writer per node, and every input checked before the first write.

Run as an operator would, with the real ``katamgr`` command in separate processes
on a simulated node: a second katamgr waits for the node lock and then fails having
changed nothing; concurrent applies and a revert leave no GPU stranded on vfio-pci;
a bad containerd config or an unwritable one stops apply before it binds anything (exit 2
for bad input); a registry that is down fails its runtime class alone (exit 3: the GPUs are
bound, the CDI specs written, the class named and left out of containerd).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from support.hostkit import GPU_A10, dev, driver_of, make_host
from support.kataconfig import kata_manager_yaml

from gpunode.services.lock import node_lock
from nodesim.marker import MARKER

REPO = Path(__file__).resolve().parents[1]
while not (REPO / "pyproject.toml").exists():
    REPO = REPO.parent
KATAMGR = str(Path(sys.executable).parent / "katamgr")
LAYOUT = REPO / "examples" / "oci-layout"
GPUS = ["0000:01:00.0", "0000:02:00.0", "0000:03:00.0"]
CONTAINERD = b'version = 2\n\n[plugins."io.containerd.grpc.v1.cri".containerd]\n  default_runtime_name = "runc"\n'


def node(tmp_path):
    host = make_host(tmp_path, [dev(b, GPU_A10, "nvidia", 4 + i) for i, b in enumerate(GPUS)])
    shutil.copytree(LAYOUT, host.path("/opt/kata-artifacts/layout"))
    host.path("/etc/containerd").mkdir(parents=True)
    host.path("/etc/containerd/config.toml").write_bytes(CONTAINERD)
    return host


def config(tmp_path, url="oci-layout:///opt/kata-artifacts/layout:kata-qemu-nvidia-gpu") -> str:
    path = tmp_path / "kata-manager.yaml"
    path.write_text(kata_manager_yaml(url=url))
    return str(path)


def katamgr(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    # No cluster: these runs must not find a kubeconfig and try one.
    env = {**os.environ, "KUBECONFIG": "/nonexistent"}
    return subprocess.run([KATAMGR, *args], capture_output=True, text=True, timeout=timeout, env=env)


def whole(host) -> dict[str, str]:
    """Every path under the host root with its content or link target (the simulator's
    own marker aside), so "nothing changed" means nothing."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(host.root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(host.root))
            if rel == MARKER:
                continue
            if path.is_symlink():
                state[rel] = "-> " + os.readlink(path)
            elif path.is_file():
                state[rel] = path.read_bytes().hex()
            else:
                state[rel] = "<dir>"
    return state


STATE = "var/lib/kata-sandbox-manager"


def but_the_lock(snapshot: dict[str, str], before: dict[str, str]) -> dict[str, str]:
    """``snapshot`` less the node lock file and the dirs made to hold it (the one
    thing a refused run may leave: taking the lock comes before any check)."""
    lock_dirs = {"var", "var/lib", STATE} - before.keys()
    return {k: v for k, v in snapshot.items() if k not in lock_dirs and k != f"{STATE}/node.lock"}


def test_a_second_katamgr_waits_for_the_lock_then_fails_changing_nothing(tmp_path):
    host = node(tmp_path)
    before = whole(host)
    with node_lock(host, "katamgr apply (test)", 0):
        busy = katamgr("apply", "--host-root", str(host.root), "--wait", "0.5")
        after_busy = whole(host)
    assert busy.returncode == 1, busy.stderr
    assert f"pid {os.getpid()} (katamgr apply (test)" in busy.stderr
    assert "--wait" in busy.stderr and "nothing was changed" in busy.stderr
    assert but_the_lock(after_busy, before) == before
    done = katamgr("apply", "--host-root", str(host.root))
    assert done.returncode == 0, done.stderr
    assert [driver_of(host, b) for b in GPUS] == ["vfio-pci"] * 3


def test_concurrent_applies_and_a_revert_strand_nothing(tmp_path):
    reference = node(tmp_path / "reference")
    assert katamgr("apply", "--host-root", str(reference.root)).returncode == 0
    assert katamgr("revert", "--host-root", str(reference.root)).returncode == 0
    host = node(tmp_path / "raced")
    results: list[subprocess.CompletedProcess] = []

    def run(*args):
        results.append(katamgr(*args, "--host-root", str(host.root)))

    threads = [threading.Thread(target=run, args=("apply",)) for _ in range(3)]
    threads.append(threading.Thread(target=run, args=("revert",)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    # Whatever order they ran in, one more revert gives every GPU back and leaves the
    # node exactly as one apply and one revert leave it: no GPU on vfio-pci without a
    # record to give it back, no record of a device that is not on vfio-pci.
    final = katamgr("revert", "--host-root", str(host.root))
    assert final.returncode == 0, final.stderr
    assert [driver_of(host, b) for b in GPUS] == ["nvidia"] * 3
    assert whole(host) == whole(reference)


@pytest.mark.parametrize("case", ["invalid-toml", "immutable"])
def test_bad_inputs_stop_apply_before_the_first_write(tmp_path, case):
    host = node(tmp_path)
    url = "oci-layout:///opt/kata-artifacts/layout:kata-qemu-nvidia-gpu"
    conf = host.path("/etc/containerd/config.toml")
    if case == "invalid-toml":
        conf.write_text("version = 2\n[plugins\n")
    cfg = config(tmp_path, url)
    before = whole(host)
    if case == "immutable":
        subprocess.run(["chattr", "+i", str(conf)], check=True)
    try:
        result = katamgr("apply", "--host-root", str(host.root), "--config", cfg)
    finally:
        if case == "immutable":
            subprocess.run(["chattr", "-i", str(conf)], check=True)
    expected = {"invalid-toml": 2, "immutable": 2}[case]
    assert result.returncode == expected, result.stderr
    assert "nothing was changed" in result.stderr
    fragment = {"invalid-toml": "config.toml", "immutable": "cannot be written"}[case]
    assert fragment in result.stderr
    assert [driver_of(host, b) for b in GPUS] == ["nvidia"] * 3
    assert but_the_lock(whole(host), before) == before


def test_a_registry_that_is_down_fails_its_class_alone(tmp_path):
    host = node(tmp_path)
    path = tmp_path / "kata-manager.yaml"
    # Two classes; the -snp one names a registry nobody listens on (the discard port), as
    # examples/values/mixed-cluster.yaml's placeholder mirror does on a real cluster.
    path.write_text(kata_manager_yaml(("kata-qemu-nvidia-gpu", "kata-qemu-nvidia-gpu-snp")).replace(
        "oci-layout:///opt/kata-artifacts/layout:kata-qemu-nvidia-gpu-snp", "127.0.0.1:9/kata/artifacts:v1"))
    result = katamgr("apply", "--host-root", str(host.root), "--config", str(path))
    assert result.returncode == 3, result.stderr  # partly done
    assert "error: runtime class kata-qemu-nvidia-gpu-snp: 127.0.0.1:9/kata/artifacts:v1: cannot reach" \
        in result.stderr
    assert "partly done: runtime class(es) kata-qemu-nvidia-gpu-snp failed and are not offered" in result.stderr
    assert "katamgr revert" not in result.stderr
    # The GPUs, the CDI spec and the good class are in place; the failed class is not in containerd.
    assert [driver_of(host, b) for b in GPUS] == ["vfio-pci"] * 3
    assert host.path("/var/run/cdi/nvidia.com-GA102GL_A10.yaml").is_file()
    containerd = host.path("/etc/containerd/config.toml").read_text()
    assert "runtimes.kata-qemu-nvidia-gpu]" in containerd and "kata-qemu-nvidia-gpu-snp" not in containerd
    # plan asks each source for its manifest: the class is a problem there, by name (exit 4).
    plan = katamgr("plan", "--host-root", str(host.root), "--config", str(path))
    assert plan.returncode == 4, plan.stderr
    assert "runtime class kata-qemu-nvidia-gpu-snp: 127.0.0.1:9/kata/artifacts:v1: cannot reach" in plan.stdout
    assert "it would not be installed or offered on this node" in plan.stdout


def test_a_failure_after_the_first_write_says_what_is_left_and_how_to_undo_it(tmp_path):
    from support.hostkit import tune

    host = node(tmp_path)
    tune(host, fail_probe=["0000:03:00.0"])  # the kernel refuses vfio-pci for one GPU
    result = katamgr("apply", "--host-root", str(host.root))
    assert result.returncode == 1
    assert "changed: bound 0000:01:00.0" in result.stdout
    assert f"katamgr revert --host-root {host.root}" in result.stderr
    assert driver_of(host, "0000:03:00.0") == "nvidia"  # its group was rolled back
    undo = katamgr("revert", "--host-root", str(host.root))
    assert undo.returncode == 0 and [driver_of(host, b) for b in GPUS] == ["nvidia"] * 3


def test_an_override_left_by_someone_else_is_not_recorded_as_the_original(tmp_path):
    host = node(tmp_path)
    # Another tool's bind was cut short: the override says vfio-pci, the device is still on nvidia.
    host.path("/sys/bus/pci/devices/0000:01:00.0/driver_override").write_text("vfio-pci\n")
    assert katamgr("apply", "--host-root", str(host.root)).returncode == 0
    assert katamgr("revert", "--host-root", str(host.root)).returncode == 0
    assert driver_of(host, "0000:01:00.0") == "nvidia"
    assert host.path("/sys/bus/pci/devices/0000:01:00.0/driver_override").read_text().strip() in ("", "(null)")
