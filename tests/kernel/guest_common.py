"""The real-kernel suite's guest side, shared by its steps: the results file, the kernel's
sysfs read as data, commands run to a bound, and a nested QEMU given one PCI function
(``guest_checks.py`` runs the steps; see its docstring)."""

from __future__ import annotations

import calendar
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp")
RESULTS = OUT / "results.json"
BIN = Path(sys.executable).parent  # the .venv's console scripts beside its python
KATAMGR = str(BIN / "katamgr")
PLUGIN = str(BIN / "sandbox-device-plugin")
QEMU = "qemu-system-x86_64"

EDU = "1234:11e8"
VGA = "1234:1111"
NIC = "8086:100e"
EDU_RESOURCE = "example.com/edu"
VGA_RESOURCE = "example.com/vga"
SELECTION = ["--include-device", f"{EDU}={EDU_RESOURCE}", "--include-device", f"{VGA}={VGA_RESOURCE}"]
PCI = Path("/sys/bus/pci")

results: dict = {"steps": {}, "order": [], "started": time.time(), "finished": False}


def save() -> None:
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.rename(RESULTS)


def record(name: str, **data) -> dict:
    results["steps"][name] = data
    results["order"].append(name)
    save()
    print(f"guest_checks: {name}: {_summary(data)}", flush=True)
    return data


def _summary(data: dict) -> str:
    keys = ("rc", "seconds", "timed_out", "error")
    return ", ".join(f"{k}={data[k]!r}" for k in keys if k in data) or "recorded"


# ---- reading the kernel ----------------------------------------------------------


def read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def driver_of(bdf: str) -> str | None:
    link = PCI / "devices" / bdf / "driver"
    return os.path.basename(os.readlink(link)) if link.is_symlink() else None


def ids_of(bdf: str) -> str:
    base = PCI / "devices" / bdf
    return f"{int(read(base / 'vendor'), 16):04x}:{int(read(base / 'device'), 16):04x}"


def group_of(bdf: str) -> int | None:
    link = PCI / "devices" / bdf / "iommu_group"
    return int(os.path.basename(os.readlink(link))) if link.is_symlink() else None


def groups() -> dict[str, list[dict]]:
    """Every IOMMU group the kernel made, with what is in it (kernel
    Documentation/ABI/testing/sysfs-kernel-iommu_groups: /sys/kernel/iommu_groups/N/devices)."""
    found: dict[str, list[dict]] = {}
    root = Path("/sys/kernel/iommu_groups")
    for entry in sorted(root.iterdir(), key=lambda p: int(p.name)) if root.is_dir() else []:
        found[entry.name] = [
            {"bdf": bdf, "ids": ids_of(bdf), "class": read(PCI / "devices" / bdf / "class"),
             "driver": driver_of(bdf)}
            for bdf in sorted(os.listdir(entry / "devices"))
        ]
    return found


def vfio_nodes() -> dict[str, str]:
    """/dev/vfio's entries with their modes (octal)."""
    nodes = {}
    for base in (Path("/dev/vfio"), Path("/dev/vfio/devices")):
        if base.is_dir():
            for entry in sorted(base.iterdir()):
                if not entry.is_dir():
                    nodes[str(entry)] = oct(entry.stat().st_mode & 0o7777)
    return nodes


def snapshot() -> dict:
    return {
        "drivers": {bdf: driver_of(bdf) for bdf in sorted(os.listdir(PCI / "devices"))},
        "vfio_nodes": vfio_nodes(),
        "driver_override": {bdf: read(PCI / "devices" / bdf / "driver_override")
                            for bdf in STAND_INS.values() if bdf},
    }


def find_stand_ins() -> dict[str, str | None]:
    """The stand-ins' BDFs, told apart by their ids and whether their group is shared."""
    found: dict[str, str | None] = {"edu": None, "vga": None, "shared_edu": None, "nic": None}
    for bdf in sorted(os.listdir(PCI / "devices")):
        ids, group = ids_of(bdf), group_of(bdf)
        endpoints = [b for b in os.listdir(f"/sys/kernel/iommu_groups/{group}/devices")
                     if not (read(PCI / "devices" / b / "class") or "").startswith("0x0604")]
        if ids == EDU:
            found["shared_edu" if len(endpoints) > 1 else "edu"] = bdf
        elif ids == VGA:
            found["vga"] = bdf
        elif ids == NIC:
            found["nic"] = bdf
    return found


def dmesg() -> list[str]:
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.splitlines()


def dmesg_tail(lines: int = 40) -> list[str]:
    return dmesg()[-lines:]


# What vfio-pci logs the moment an unbind starts waiting for a device a user holds:
# it asks the user to release it ("Relaying device request to user (#0)", or without
# a request channel "No device request channel registered, blocked until released by
# user"), then the writer waits (Linux 6.1 drivers/vfio/pci/vfio_pci_core.c,
# vfio_pci_core_request; drivers/vfio/vfio_main.c, vfio_unregister_group_dev).
UNBIND_WAITS = ("Relaying device request to user", "blocked until released by user",
                "blocked until device is released")


def unbind_waits(lines: list[str], bdf: str) -> list[str]:
    return [line for line in lines if bdf in line and any(w in line for w in UNBIND_WAITS)]


STAND_INS: dict[str, str | None] = {}


# ---- running commands ------------------------------------------------------------


def run(argv: list[str], timeout: float) -> dict:
    """Run a command to its end or ``timeout``; what it did, as data."""
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # blocked in the kernel, unkillable
            stdout, stderr = "", "(did not die after SIGKILL)"
        timed_out = True
    return {"argv": argv, "rc": proc.returncode, "stdout": stdout, "stderr": stderr,
            "seconds": round(time.monotonic() - started, 2), "timed_out": timed_out}


def sysfs_write(path: Path, value: str) -> dict:
    """One write to a sysfs control file, as a person at a shell would do it."""
    started = time.monotonic()
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)
        error = None
    except OSError as exc:
        error = f"{exc.strerror} (errno {exc.errno})"
    return {"path": str(path), "value": value, "error": error, "seconds": round(time.monotonic() - started, 3)}


class NestedQemu:
    """A QEMU in the guest given one PCI function with ``-device vfio-pci,host=BDF``,
    as Kata's QEMU is given a GPU (QEMU's vfio-pci device, hw/vfio/pci.c; its
    properties: ``-device vfio-pci,help``). ``-S``: the VM never runs; QEMU still
    opens the group and the device and maps the VM's memory while it sets the device
    up, which is what is checked. TCG (there is no KVM in the guest), with a small
    translation buffer (``tb-size``, MiB) to fit the guest's memory."""

    def __init__(self, bdf: str) -> None:
        self.bdf = bdf
        self.argv = [QEMU, "-nodefaults", "-display", "none", "-S", "-machine", "pc",
                     "-accel", "tcg,tb-size=16", "-m", "64", "-monitor", "none", "-serial", "none",
                     "-device", f"vfio-pci,host={bdf}"]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)

    def holds(self, node: str) -> bool:
        fds = Path(f"/proc/{self.proc.pid}/fd")
        with contextlib.suppress(OSError):
            for fd in fds.iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) == node:
                        return True
        return False

    def wait_open(self, node: str, timeout: float) -> dict:
        """Until QEMU holds ``node`` open (and, since it opens the device fd right
        after, a moment more), exits, or ``timeout``."""
        deadline = self.started + timeout
        held_at = None
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.holds(node):
                held_at = time.monotonic() - self.started
                break
            time.sleep(0.1)
        # The device fd follows the group fd; vfio-pci's realize maps guest RAM too.
        # Give it a little longer to fail, if it is going to.
        if held_at is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=3)
        running = self.proc.poll() is None
        return {"argv": self.argv, "node": node, "held": held_at is not None and running,
                "seconds_to_open": None if held_at is None else round(held_at, 2),
                "exited": None if running else self.proc.returncode,
                "stderr": None if running else self.proc.stderr.read()}

    def wait_exit(self, timeout: float) -> dict:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"argv": self.argv, "exited": None, "seconds": None, "stderr": None}
        return {"argv": self.argv, "exited": self.proc.returncode,
                "seconds": round(time.monotonic() - self.started, 2), "stderr": self.proc.stderr.read()}

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=20)
        return self.proc.poll()


# Every katamgr command logs verbosely as JSON lines: the first record's time tells
# the interpreter's start-up (imports, slow under TCG) from the command's own work.
LOGGING = ["-v", "--log-format", "json"]


def timing(started_at: float, stderr: str, ended_at: float | None = None) -> dict:
    """``startup_s``: from exec to the command's first log record; ``work_s``: from
    there to its exit (``ended_at``, or now; None without a log record)."""
    ended_at = time.time() if ended_at is None else ended_at
    first = None
    for line in stderr.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError, KeyError):
                stamp = json.loads(line)["time"]  # 2026-11-22T18:14:44.733Z
                first = calendar.timegm(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")) + float("0" + stamp[19:-1])
                break
    if first is None:
        return {"startup_s": None, "work_s": None}
    return {"startup_s": round(first - started_at, 2), "work_s": round(ended_at - first, 2)}
