"""Kata's own cold-plug code, as the tests ask it: the oracle hack/kata/build builds.

``hack/kata/oracle`` is a small Go program of ours on the runtime code of each Kata release
pinned in ``hack/kata/versions`` (Kata 3.25.0 and 3.29.0 from the Go module proxy; Kata 4.1.0,
which the proxy does not serve, from a source tree the runner gives: ``KATA_SRC_DIR`` holding
its ``git archive`` tarball, or a kata-containers clone ``KATA_GIT_DIR``). Given the kubelet's PodResources
socket, the CDI spec dirs, the node's root (its /sys and /dev) and the pod, it runs the
shim's sandbox cold-plug and the sandbox's VFIO assembly and prints what Kata does: the CDI
names, the device nodes injected, the VFIO functions, QEMU's ``-device`` arguments, or
Kata's error. It is the test of record for every Kata outcome; the stand-in
(``nodesim.kata_shim``) is checked against it.

A simulated node is shown to Kata in a private mount namespace of the oracle's (its /sys
and /dev), so the oracle needs root there, as the tests' real parts do.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.paths import REPO, REQUIRE_INTEGRATION

BUILD = REPO / "hack" / "kata" / "build"
VERSIONS = REPO / "hack" / "kata" / "versions"
# A cold build of both releases takes a few minutes on 2 cores (the module downloads and
# Kata's packages); .ci/run builds before the tests, a newcomer's first pytest may build here.
BUILD_TIMEOUT = 1800
RUN_TIMEOUT = 60


def releases(*, from_source: bool = False) -> tuple[str, ...]:
    """The pinned Kata releases the module proxy serves (``from_source``: those built from a
    source tree the proxy does not serve, a tarball or a git clone), oldest first."""
    out = []
    for line in VERSIONS.read_text().splitlines():
        fields = line.split()
        if fields and not fields[0].startswith("#") and (fields[2:3] == ["source"]) == from_source:
            out.append(fields[0])
    return tuple(out)


RELEASES = releases()
SOURCE_RELEASES = releases(from_source=True)
# The NVSwitch and one-device-per-group behaviour of 3.x is the same in every release above.
OLDEST, NEWEST = RELEASES[0], RELEASES[-1]
# Kata 4.1 cold-plugs NVSwitches (the full passthrough model); the proxy does not serve it.
NVSWITCH_RELEASE = "4.1.0"
assert NVSWITCH_RELEASE in SOURCE_RELEASES


def exact_bridges(release: str) -> bool:
    """Whether Kata ``release`` leaves out only host bridges (class 0x0600) and PCI-to-PCI
    bridges (0x0604) of a VFIO group, so an NVSwitch (0x0680) reaches the VM: Kata 4.1's
    ``pciClassesIgnoredForPassthrough`` and ``checkIgnorePCIClass``
    (``src/runtime/pkg/device/drivers/utils.go``). Before, any class with ``& 0x0600 ==
    0x0600`` was left out (``checkIgnorePCIClass`` of 3.x), an NVSwitch with it."""
    return tuple(int(p) for p in release.split(".")) >= (4, 1)


def source_given() -> bool:
    """Whether the runner gave the source of the releases the proxy does not serve: a dir of
    ``kata-runtime-<release>.tar.gz`` (KATA_SRC_DIR; .ci/run's, where shared/ is beside the
    checkout) or a kata-containers clone (KATA_GIT_DIR). hack/kata/build reads the same."""
    return bool(os.environ.get("KATA_SRC_DIR") or os.environ.get("KATA_GIT_DIR"))


NOT_GIVEN = ("is built from a source tree the Go module proxy does not serve: set KATA_SRC_DIR "
             "(a dir holding kata-runtime-<release>.tar.gz, `git archive <tag> src/runtime`) or "
             "KATA_GIT_DIR (a kata-containers clone); hack/kata/versions")


def judges() -> list:
    """Every pinned release, oldest first, as pytest parameters: the cold-plug cases run on
    each. A release built from a source tree is marked ``kata_source``: without its source
    (KATA_SRC_DIR, KATA_GIT_DIR) its cases are left out, and the summary names them."""
    return [pytest.param(r, marks=pytest.mark.kata_source) if r in SOURCE_RELEASES else r
            for r in sorted(RELEASES + SOURCE_RELEASES, key=lambda r: tuple(map(int, r.split("."))))]


def here() -> tuple[str, ...]:
    """The pinned releases whose oracle can be built here, oldest first."""
    return tuple(p if isinstance(p, str) else p.values[0] for p in judges()
                 if isinstance(p, str) or source_given())


def missing_part() -> str | None:
    """Why the oracle cannot run here, or None."""
    if shutil.which("go") is None and not (REPO / ".venv" / "bin" / "go").exists():
        return "no Go toolchain to build Kata's runtime code (install Go 1.25+)"
    if os.geteuid() != 0:
        return "the Kata oracle shows Kata a simulated node in a mount namespace: run as root"
    return None


@functools.cache
def bin_dir() -> Path:
    """hack/kata/build's bin dir (built once, then cached: every release here, those from a
    source tree too where it is given); skips (fails in CI) when it cannot."""
    why = missing_part()
    if why is None:
        done = subprocess.run([str(BUILD)], capture_output=True, text=True, timeout=BUILD_TIMEOUT)
        if done.returncode == 0:
            return Path(done.stdout.strip())
        why = f"hack/kata/build failed ({done.returncode}): {done.stderr[-2000:]}"
    if REQUIRE_INTEGRATION:
        pytest.fail(why)
    pytest.skip(why)


VFIO_ID = re.compile(r",id=vfio-[0-9a-f]+")


@dataclass(frozen=True)
class Function:
    bdf: str
    pci_class: str
    pcie: bool
    bus: str


@dataclass(frozen=True)
class Outcome:
    """What one Kata release does with a pod's devices when it creates the sandbox."""

    kata: str
    cdi_devices: tuple[str, ...]
    device_nodes: tuple[str, ...]  # container paths, in the order the OCI spec has them
    vfio: tuple[tuple[str, tuple[Function, ...]], ...]  # (host node, its functions) per device
    plugged: tuple[str, ...]  # the BDFs QEMU gets a vfio-pci -device for, in order
    qemu_args: tuple[str, ...]
    root_ports: int
    stage: str  # "ready", or where Kata failed: pod-resources, cdi, sandbox-config, sandbox
    error: str | None
    config: Mapping
    log: tuple[str, ...]
    raw: Mapping

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def vfio_args(self) -> list[str]:
        """QEMU's -device vfio-pci arguments, as Kata writes them."""
        args = self.qemu_args
        return [args[i + 1] for i in range(len(args) - 1)
                if args[i] == "-device" and args[i + 1].startswith("vfio-pci,")]

    @property
    def plain_vfio_args(self) -> list[str]:
        """``vfio_args`` less the ``id=`` Kata 4.1 writes after ``host=`` (govmm's
        ``VFIODevice.QemuParams``, so that QMP finds a cold-plugged device: the VFIO device's
        ID, ``vfio-`` and the device manager's random hex ID and the function's index). It is
        there in 4.1 and later, not before."""
        out = []
        for arg in self.vfio_args:
            plain, n = VFIO_ID.subn("", arg)
            assert n == (1 if exact_bridges(self.kata) else 0), f"Kata {self.kata}: {arg}"
            out.append(plain)
        return out


def run(release: str, *, pod: tuple[str, str] | None, root: os.PathLike | str = "/",
        pod_resources: os.PathLike | str | None = None, cdi_dirs: Iterable[os.PathLike | str] = (),
        kata_config: os.PathLike | str | None = None, cold_plug_vfio: str | None = None,
        annotations: Mapping[str, str] | None = None) -> Outcome:
    """Ask Kata ``release`` what it does for the pod (namespace, name) on the node at ``root``.
    ``cdi_dirs`` are paths as this machine sees them (default Kata's: /etc/cdi, /var/run/cdi)."""
    if release in SOURCE_RELEASES and not source_given():
        # Where its code comes from is the runner's to say; conftest leaves such cases out.
        pytest.skip(f"Kata {release} {NOT_GIVEN}")
    argv = [str(bin_dir() / f"kata-oracle-{release}"), "--root", str(root)]
    if pod is not None:
        argv += ["--pod", f"{pod[0]}/{pod[1]}"]
    if pod_resources is not None:
        argv += ["--pod-resources", str(pod_resources)]
    for directory in cdi_dirs:
        argv += ["--cdi-dir", str(directory)]
    if kata_config is not None:
        argv += ["--kata-config", str(kata_config)]
    if cold_plug_vfio is not None:
        argv += ["--cold-plug-vfio", cold_plug_vfio]
    for key, value in (annotations or {}).items():
        argv += ["--annotation", f"{key}={value}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    if done.returncode not in (0, 1):
        raise AssertionError(f"kata-oracle-{release} failed ({done.returncode}): {done.stderr}")
    raw = json.loads(done.stdout)
    return Outcome(
        kata=raw["kata"],
        cdi_devices=tuple(raw["cdi_devices"]),
        device_nodes=tuple(d["path"] for d in raw["device_nodes"]),
        vfio=tuple((g["host_path"], tuple(Function(f["bdf"], f["class"], f["pcie"], f["bus"])
                                          for f in g["functions"])) for g in raw["vfio"]),
        plugged=tuple(raw["plugged"]),
        qemu_args=tuple(raw["qemu_args"]),
        root_ports=raw["root_ports"],
        stage=raw["stage"],
        error=raw["error"],
        config=raw["config"],
        log=tuple(raw["log"]),
        raw=raw,
    )


def on_simulated_node(release: str, host, socket, namespace: str, name: str, **kw) -> Outcome:
    """``run`` on a simulated node (a HostRoot): its root, and its CDI dirs as Kata's defaults."""
    dirs = [host.path(d) for d in ("/etc/cdi", "/var/run/cdi")]
    return run(release, pod=(namespace, name), root=host.root, pod_resources=socket, cdi_dirs=dirs, **kw)
