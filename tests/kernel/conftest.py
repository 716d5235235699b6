"""The real-kernel suite: one guest boot per test session, many small checks.

The session fixture ``guest`` fetches Debian's stock kernel (cached outside the
repository, tests/support/kernelvm.py), builds the initramfs, boots the guest
with the stand-in devices and lets the guest's init run tests/kernel/guest_checks.py
inside the host's tree. That script performs every step with katamgr's and the
device plugin's real commands against the guest's real sysfs and writes
results.json into a writable 9p share (a temp dir of this session); each test
then asserts one behaviour from those results and, when it fails, shows the
step's output and the guest console's tail.

Under REQUIRE_INTEGRATION=1 (CI) a missing qemu, busybox, cpio or kernel is a
failure, never a skip. ``pytest tests/kernel`` runs the suite alone; its run time
is printed in the terminal summary ("real-kernel suite: ...").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import guestmonitor, kataoracle, kerneltree, kernelvm
from support.paths import REPO, REQUIRE_INTEGRATION

GUEST_SCRIPT = Path(__file__).with_name("guest_checks.py")
# Bounds on the whole run (this 2-core machine under TCG: boot ~10 s, the whole run
# under 2 minutes; several times that when the machine is busy with other work).
BOOT_TIMEOUT = float(os.environ.get("KATAMGR_KERNEL_BOOT_TIMEOUT", "120"))
TOTAL_TIMEOUT = float(os.environ.get("KATAMGR_KERNEL_TIMEOUT", "600"))
TOOLS = ("qemu-system-x86_64", "cpio", "depmod", "modprobe", "apt-get", "dpkg-deb")

_timing: dict[str, object] = {}


@dataclass
class GuestResults:
    run: kernelvm.GuestRun
    kernel: kerneltree.KernelTree
    data: dict

    def step(self, name: str) -> dict:
        """The step's record, or a failure saying why the guest has none."""
        steps = self.data.get("steps", {})
        if name not in steps:
            pytest.fail(f"the guest recorded no {name!r} step.\n{self.why_incomplete()}", pytrace=False)
        return steps[name]

    def why_incomplete(self) -> str:
        parts = [f"guest run: {self.run.timed_out or 'powered off'} after {self.run.total_s:.0f} s "
                 f"({', '.join(self.run.attempts)}); steps recorded: {', '.join(self.data.get('order', [])) or 'none'}"]
        for error in self.data.get("errors", []):
            parts.append(f"guest step error: {error}")
        parts.append("guest console (tail):\n" + self.run.console_tail())
        return "\n".join(parts)


def _unavailable(message: str) -> None:
    if REQUIRE_INTEGRATION:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def _warm_bytecode() -> None:
    """Compile the repository's packages on the host first: the guest runs them from a
    read-only share under TCG, where compiling them again in every process costs seconds."""
    packages = [str(p.parent) for p in REPO.glob("*/__init__.py") if p.parent.name != "tests"]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *packages],  # noqa: S603
                   capture_output=True, timeout=120, check=False)


@pytest.fixture(scope="session")
def guest(tmp_path_factory) -> GuestResults:
    missing = [tool for tool in TOOLS if not kerneltree.which(tool)]
    if not kernelvm.BUSYBOX.exists():
        missing.append("busybox-static")
    if missing:
        _unavailable(f"the real-kernel suite needs {', '.join(missing)} (run: bash .ci/setup)")
    started = time.monotonic()
    try:
        kernel = kerneltree.fetch_kernel()
    except kerneltree.KernelVmError as exc:
        _unavailable(f"no kernel to boot: {exc}")
    fetched = time.monotonic() - started
    # Kata's cold-plug code (hack/kata/build's oracle, built here): the guest runs it on the
    # real kernel's sysfs and /dev/vfio, from the host's tree it shares.
    oracle_bin = kataoracle.bin_dir()
    out = tmp_path_factory.mktemp("kernel-results")
    work = tmp_path_factory.mktemp("kernel-vm")
    _warm_bytecode()
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root",
        # This checkout first, as for every command the tests run (CI sets
        # PYTHONPATH to its fresh clone).
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        "PYTHONUNBUFFERED": "1",
        "KATA_ORACLE_BIN": str(oracle_bin),
        "KATA_RELEASES": " ".join(kataoracle.RELEASES),
    }
    command = kernelvm.GuestCommand(
        argv=(sys.executable, str(GUEST_SCRIPT), str(out)), cwd=str(REPO), env=env, writable=(str(out),),
    )
    try:
        # The guest's health checks ask for AER errors and a hot-unplug through the share.
        with guestmonitor.MonitorRelay(out, kernelvm.monitor_socket(work)):
            run = kernelvm.boot(kernel, command, work, boot_timeout=BOOT_TIMEOUT, total_timeout=TOTAL_TIMEOUT)
    except kerneltree.KernelVmError as exc:
        _unavailable(f"the guest could not be started: {exc}")
    results_file = out / "results.json"
    data = json.loads(results_file.read_text()) if results_file.exists() else {}
    _timing.update(total=time.monotonic() - started, fetch=fetched, boot=run.boot_s, guest=run.total_s,
                   accel=run.accel.name, why=run.accel.why, kernel=kernel.release, steps=data.get("seconds"),
                   commands={name: (step.get("startup_s"), step.get("work_s"))
                             for name, step in data.get("steps", {}).items() if "work_s" in step},
                   health=_health_figures(data.get("steps", {}).get("health", {})))
    result = GuestResults(run, kernel, data)
    if not data.get("finished"):
        # Every test would fail on its own; say once, up front, why.
        sys.stderr.write(f"\nreal-kernel suite: the guest did not finish its steps.\n{result.why_incomplete()}\n")
    return result


def _health_figures(step: dict) -> str | None:
    """Fault to Unhealthy at ListAndWatch in the guest (guest_health.py), as a line."""
    times = [(i["kind"], i.get("unhealthy_s")) for i in step.get("injections", []) if "unhealthy_s" in i]
    unplug = step.get("unplug", {}).get("unhealthy_after_removal_s")
    if not times and unplug is None:
        return None
    known = sorted(t for _, t in times if t is not None)
    p50 = f"{known[len(known) // 2]:.2f} s" if known else "-"
    each = ", ".join(f"{kind} {'-' if t is None else f'{t:.2f}'}" for kind, t in times)
    return f"AER error to Unhealthy p50 {p50} ({each}); hot-unplug to Unhealthy {unplug} s"


def pytest_terminal_summary(terminalreporter) -> None:
    if not _timing:
        return
    boot = _timing["boot"]
    terminalreporter.write_line(
        f"real-kernel suite: {_timing['total']:.0f} s (kernel {_timing['kernel']} under {_timing['accel']}: "
        f"{_timing['why']}; kernel fetch {_timing['fetch']:.1f} s, boot to init "
        f"{'-' if boot is None else f'{boot:.0f} s'}, guest steps {_timing['steps'] or '-'} s, "
        f"guest run {_timing['guest']:.0f} s)"
    )
    if _timing.get("health"):
        terminalreporter.write_line(f"real-kernel suite: health at ListAndWatch: {_timing['health']}")
    commands = ", ".join(f"{name} {start}+{work}" for name, (start, work) in _timing["commands"].items())
    if commands:
        terminalreporter.write_line(f"real-kernel suite: katamgr in the guest, start-up+work seconds: {commands}")

