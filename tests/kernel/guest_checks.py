"""The real-kernel suite's guest side: run by the guest's init, inside the host's tree.

``python tests/kernel/guest_checks.py OUT_DIR`` runs every step of the suite against
the guest's real kernel and real sysfs, with katamgr's and the device plugin's real
commands, and writes what it saw to ``OUT_DIR/results.json`` after each step (so a
run cut short still tells how far it got). It asserts nothing: the host-side tests
(tests/kernel/test_*.py) read the results and each checks one behaviour.

The stand-ins (tests/support/kernelvm.py ``Topology``) are found by their PCI ids,
never by address: QEMU's ``edu`` (1234:11e8, no Linux driver) alone in its IOMMU
group, the ``VGA`` (1234:1111, Linux's ``bochs-drm``) alone in its group, and an
``edu`` that shares its group with an ``e1000`` NIC behind a PCIe-to-PCI bridge.

Each step is bounded; a step that outlives its bound is killed and recorded as
timed out, and the steps after it still run.
"""

from __future__ import annotations

import calendar
import contextlib
import ctypes
import dataclasses
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import guest_health  # beside this script (its directory is first on sys.path)

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


# ---- the steps ---------------------------------------------------------------------


def step_facts() -> None:
    record("facts", release=os.uname().release, cmdline=read(Path("/proc/cmdline")),
           groups=groups(), stand_ins=STAND_INS,
           iommufd={"dev_iommu": os.path.exists("/dev/iommu"),
                    "dev_vfio_devices": os.path.exists("/dev/vfio/devices")},
           vfio_pci_loaded=(PCI / "drivers" / "vfio-pci").is_dir())


def step_original_drivers() -> None:
    # No udev in the guest, so nothing loads drivers for the devices found at boot
    # (module autoloading is udev acting on uevents' MODALIAS): load the originals.
    loads = {module: run(["modprobe", module], 60) for module in ("e1000", "bochs")}
    record("original_drivers", loads=loads, groups=groups(), **snapshot())


# Every katamgr command logs verbosely as JSON lines: the first record's time tells
# the interpreter's start-up (imports, slow under TCG) from the command's own work.
LOGGING = ["-v", "--log-format", "json"]


def katamgr(name: str, args: list[str], timeout: float = 180) -> dict:
    started_at = time.time()
    result = run([KATAMGR, *args, *LOGGING], timeout)
    result.update(timing(started_at, result["stderr"]), after=snapshot())
    # plan exits 4 when it lists problems (katamgr/exitcodes.py), its document printed all the same
    if args[:1] == ["plan"] and "--output" in args and result["rc"] in (0, 4):
        with contextlib.suppress(ValueError):
            result["json"] = json.loads(result["stdout"])
    return record(name, **result)


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


class Plugin:
    """``sandbox-device-plugin`` started early: its start-up (seconds of imports under
    TCG) overlaps the second apply, which it does not disturb (it only reads). Like
    the real one it waits for kubelet.sock to appear and then registers."""

    def __init__(self) -> None:
        self.log_path = OUT / "plugin.log"
        self.started = time.monotonic()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([PLUGIN, "--mode", "vm-passthrough", *SELECTION, "-v"],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self, data: dict) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                data["stopped_rc"] = self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                data["stopped_rc"] = "killed after 20 s"
        else:
            data["exited_early"] = self.proc.returncode
        data["log"] = self.log_path.read_text(errors="replace")[-20000:]


def import_kubelet_simulator():
    """The kubelet simulator's module (grpc and the protos: seconds under TCG)."""
    from nodesim import kubelet

    return kubelet


def step_plugin(plugin: Plugin | None) -> None:
    """The device plugin on the real kernel, with the kubelet simulator in this process."""
    from katamgr.host.root import HostRoot

    data: dict = {}
    if plugin is None:
        record("plugin", error="the plugin was not started (see the errors)")
        return
    kubelet = import_kubelet_simulator().KubeletSimulator(HostRoot.at("/"))
    kubelet.start()
    try:
        _plugin_checks(kubelet, data, plugin.started, plugin.proc.pid)
    except Exception:  # noqa: BLE001 - recorded for the host-side tests to show
        data["error"] = traceback.format_exc()
    finally:
        plugin.stop(data)
        kubelet.stop()
    record("plugin", **data)


def step_kata(kubelet) -> None:
    """Kata's own cold-plug on the real kernel: a pod given an edu and a VGA by the kubelet
    simulator (from the plugin's units), asked of each Kata release's code (the oracle, on
    the real /sys and /dev/vfio, with katamgr's CDI specs) and of the stand-in."""
    from katamgr.host.root import HostRoot
    from nodesim import kata_shim

    data: dict = {"iommufd": os.path.exists("/dev/iommu"), "config_size": {}, "kata": {}, "stand_in": {}}
    for name, bdf in STAND_INS.items():
        if bdf:
            data["config_size"][name] = os.stat(PCI / "devices" / bdf / "config").st_size
    kubelet.admit_pod("default", "kata-stand-ins", {"vm": {EDU_RESOURCE: 1, VGA_RESOURCE: 1}})
    socket = str(kubelet.pod_resources_socket)
    for release in os.environ.get("KATA_RELEASES", "").split():
        argv = [f"{os.environ['KATA_ORACLE_BIN']}/kata-oracle-{release}", "--root", "/",
                "--pod", "default/kata-stand-ins", "--pod-resources", socket, "--cdi-dir", "/var/run/cdi"]
        done = run(argv, timeout=60)
        try:
            data["kata"][release] = json.loads(done["stdout"])
        except ValueError:
            data["kata"][release] = {"run": done}
        try:
            plug = kata_shim.cold_plug(HostRoot.at("/"), socket, kata_shim.sandbox_annotations("default", "kata-stand-ins"),
                                       spec_dirs=("/var/run/cdi",), release=release)
            data["stand_in"][release] = {"cdi_devices": list(plug.cdi_names), "device_nodes": list(plug.device_nodes),
                                         "plugged": list(plug.functions), "qemu_args": plug.qemu_args}
        except kata_shim.ColdPlugError as exc:
            data["stand_in"][release] = {"error": str(exc)}
    kubelet.remove_pod("default", "kata-stand-ins")
    record("kata", **data)


def _devices(state, resource: str) -> list[dict]:
    return [{"id": d.id, "health": d.health} for d in state.devices.get(resource, [])]


def _plugin_checks(kubelet, data: dict, started: float, plugin_pid: int) -> None:
    resources = (EDU_RESOURCE, VGA_RESOURCE)
    state = kubelet.wait_for(lambda s: all(s.devices.get(r) for r in resources), timeout=90)
    data["registered_s"] = round(time.monotonic() - started, 2)
    data["plugin_pid"] = plugin_pid
    # The watcher starts right after the first scan; give it a moment (bounded).
    deadline = time.monotonic() + 5
    while not (sockets := uevent_sockets(plugin_pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    data["uevent_sockets"] = sockets
    data["registrations"] = sorted(r.resource_name for r in state.registrations)
    data["devices"] = {r: _devices(state, r) for r in resources}
    step_kata(kubelet)
    data["allocate"] = {}
    for resource in resources:
        ids = [d.id for d in state.devices[resource]]
        answer = kubelet.allocate(resource, ids[:1])
        data["allocate"][resource] = {
            "ids": ids[:1],
            "devices": [{"container_path": d.container_path, "host_path": d.host_path,
                         "permissions": d.permissions} for d in answer.devices],
            "envs": dict(answer.envs),
            "cdi_devices": [d.name for d in answer.cdi_devices],
        }
    save()
    # Unbind the VGA stand-in from vfio-pci behind the plugin's back, as an
    # operator at a shell would; its group then has no device on vfio-pci.
    vga = STAND_INS["vga"]
    vga_id = next((d.id for d in state.devices[VGA_RESOURCE]), None)
    write_started = time.monotonic()
    data["unbind"] = sysfs_write(PCI / "drivers" / "vfio-pci" / "unbind", vga)

    def listed_healthy(state) -> bool:
        return any(d.id == vga_id and d.healthy for d in state.devices.get(VGA_RESOURCE, []))

    def listed_unhealthy(state) -> bool:
        return any(d.id == vga_id and not d.healthy for d in state.devices.get(VGA_RESOURCE, []))

    # The first change the kubelet sees (Unhealthy, or the device withdrawn), then
    # whether it is (or becomes) listed as Unhealthy.
    for key, predicate in (("not_healthy_after_s", lambda s: not listed_healthy(s)),
                           ("unhealthy_after_s", listed_unhealthy)):
        try:
            kubelet.wait_for(predicate, timeout=10)
            data[key] = round(time.monotonic() - write_started, 3)
        except TimeoutError:
            data[key] = None
    data["devices_after_unbind"] = {r: _devices(kubelet.state, r) for r in resources}
    # And back: driver_override still names vfio-pci, so a probe binds it there.
    probe_started = time.monotonic()
    data["reprobe"] = sysfs_write(PCI / "drivers_probe", vga)
    try:
        kubelet.wait_for(lambda s: any(d.id == vga_id and d.healthy for d in s.devices.get(VGA_RESOURCE, [])),
                         timeout=10)
        data["healthy_again_after_s"] = round(time.monotonic() - probe_started, 3)
    except TimeoutError:
        data["healthy_again_after_s"] = None
    data["vga_driver_after_reprobe"] = driver_of(vga)


def step_nested_qemu() -> NestedQemu | None:
    """QEMU opens each group katamgr bound; the edu's QEMU is kept running as the
    holder for the revert step."""
    opened = {}
    holder = None
    machines = {}
    for name in ("edu", "vga"):
        bdf = STAND_INS[name]
        if bdf and driver_of(bdf) == "vfio-pci":
            machines[name] = NestedQemu(bdf)
    blocked = None
    for name, machine in machines.items():
        node = f"/dev/vfio/{group_of(machine.bdf)}"
        opened[name] = machine.wait_open(node, timeout=60)
        opened[name]["bdf"] = machine.bdf
        if name == "edu" and opened[name]["held"]:
            holder = machine
        elif name == "vga" and opened[name]["held"]:
            blocked = _blocked_unbind(machine)
        else:
            machine.stop()
    record("nested_qemu", opened=opened, skipped=[n for n in ("edu", "vga") if n not in machines],
           blocked_unbind=blocked)
    return holder


def _blocked_unbind(machine: NestedQemu) -> dict:
    """The kernel fact behind "never unbind a held device": an ``unbind`` written for a
    device whose group QEMU holds does not return until QEMU lets go. Written here by
    ``tee`` (one write(2)); the QEMU is then stopped, the write returns, and the
    device is probed back onto vfio-pci (its driver_override still names it)."""
    bdf = machine.bdf
    lines_before = len(dmesg())
    data: dict = {"bdf": bdf}
    writer = subprocess.Popen(["tee", str(PCI / "drivers" / "vfio-pci" / "unbind")], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    writer.stdin.write(bdf)
    writer.stdin.close()
    time.sleep(3)
    data["writer_blocked_after_3s"] = writer.poll() is None
    data["dmesg"] = dmesg()[lines_before:]
    released = time.monotonic()
    machine.stop()
    try:
        writer.wait(timeout=30)
        data["writer_rc"] = writer.returncode
        data["returned_after_release_s"] = round(time.monotonic() - released, 2)
    except subprocess.TimeoutExpired:
        data["writer_rc"] = None
        writer.kill()
    data["driver_after_release"] = driver_of(bdf)
    data["reprobe"] = sysfs_write(PCI / "drivers_probe", bdf)
    data["driver_after_reprobe"] = driver_of(bdf)
    return data


def step_not_viable() -> None:
    """The shared group with the NIC still on e1000: vfio-pci binds the edu in it, but
    the group is not viable, so QEMU refuses it (kernel Documentation/driver-api/
    vfio.rst: a group is viable only when every device in it is bound to a VFIO bus
    driver or to no driver). katamgr never binds it; this step binds it by hand."""
    bdf = STAND_INS["shared_edu"]
    data: dict = {"bdf": bdf, "nic_driver": driver_of(STAND_INS["nic"])}
    base = PCI / "devices" / bdf
    data["override"] = sysfs_write(base / "driver_override", "vfio-pci\n")
    data["probe"] = sysfs_write(PCI / "drivers_probe", bdf)
    data["driver_after_probe"] = driver_of(bdf)
    group = group_of(bdf)
    data["group"] = group
    data["group_node"] = os.path.exists(f"/dev/vfio/{group}")
    machine = NestedQemu(bdf)
    data["qemu"] = machine.wait_exit(timeout=60)
    if data["qemu"]["exited"] is None:
        data["qemu"]["still_running"] = True
        machine.stop()
    # Back as it was: no driver, no override.
    data["undo_unbind"] = sysfs_write(PCI / "drivers" / "vfio-pci" / "unbind", bdf)
    data["undo_override"] = sysfs_write(base / "driver_override", "\n")
    data["driver_after_undo"] = driver_of(bdf)
    record("not_viable", **data)


def step_revert_while_held(holder: NestedQemu | None) -> None:
    """``katamgr revert`` while a QEMU holds the edu's group: it must refuse within
    seconds. A revert still running after 180 s is recorded as hung; the holder is then
    stopped (which is what lets a blocked unbind return) and the revert's end recorded."""
    if holder is None:
        record("revert_held", error="no nested QEMU holds a group (see nested_qemu)")
        return
    node = f"/dev/vfio/{group_of(holder.bdf)}"
    lines_before = len(dmesg())
    data = {"holder_pid": holder.proc.pid, "holder_node": node, "holder_bdf": holder.bdf,
            "held_before": holder.holds(node)}
    started, started_at = time.monotonic(), time.time()
    proc = subprocess.Popen([KATAMGR, "revert", *LOGGING], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        # Generous: under TCG the interpreter's start-up alone takes tens of seconds;
        # work_s (below) is what tells a refusal from a hang.
        stdout, stderr = proc.communicate(timeout=180)
        data.update(rc=proc.returncode, timed_out=False)
    except subprocess.TimeoutExpired:
        data.update(timed_out=True, dmesg_while_hung=dmesg_tail())
        holder.stop()
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        data.update(rc=proc.returncode)
    data.update(timing(started_at, stderr), seconds=round(time.monotonic() - started, 2), stdout=stdout,
                stderr=stderr, held_after=holder.holds(node), after=snapshot())
    # Whether katamgr wrote unbind for the held device all the same (the kernel says so).
    data["unbind_waits"] = unbind_waits(dmesg()[lines_before:], holder.bdf)
    # The holder keeps the group for the forced revert (step_revert_forced).
    record("revert_held", **data)


# ---- kernel uevents ----------------------------------------------------------------

# include/uapi/linux/netlink.h
NETLINK_KOBJECT_UEVENT = 15


def uevent_sockets(pid: int) -> list[dict]:
    """``pid``'s kobject-uevent netlink sockets, from /proc/net/netlink (columns sk, Eth
    (the protocol), Pid, Groups (hex bitmask), ..., Inode) matched to its fds."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                match = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
                if match:
                    inodes.add(match.group(1))
    found = []
    for line in (read(Path("/proc/net/netlink")) or "").splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 10 and fields[9] in inodes and int(fields[1]) == NETLINK_KOBJECT_UEVENT:
            found.append({"protocol": int(fields[1]), "groups": int(fields[3], 16), "inode": fields[9]})
    return found


def _collect(sources: list, want, timeout: float) -> tuple[list[list[dict]], float | None]:
    """Events from each of ``sources`` (objects with ``fileno()`` and ``drain()``) until
    ``want(events of the first)`` holds or ``timeout``; when it held (seconds) or None."""
    got: list[list[dict]] = [[] for _ in sources]
    started = time.monotonic()
    deadline = started + timeout
    while True:
        for index, source in enumerate(sources):
            got[index] += [dataclasses.asdict(e) if dataclasses.is_dataclass(e) else e for e in source.drain()]
        if want(got[0]):
            return got, round(time.monotonic() - started, 3)
        left = deadline - time.monotonic()
        if left <= 0:
            return got, None
        select.select([s.fileno() for s in sources], [], [], min(left, 0.5))


class _AllEvents:
    """Every kernel uevent, whatever its subsystem (pyudev's netlink monitor, as
    katamgr.host.uevents opens it, without the subsystem filter): what the kernel sent
    besides what the watcher keeps."""

    def __init__(self) -> None:
        import pyudev

        self.monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source="kernel")
        self.monitor.start()

    def fileno(self) -> int:
        return self.monitor.fileno()

    def drain(self) -> list[dict]:
        found = []
        while (device := self.monitor.poll(timeout=0)) is not None:
            found.append({"action": device.action, "subsystem": device.subsystem,
                          "devpath": device.device_path, "driver": device.driver,
                          "error_event": device.properties.get("ERROR_EVENT")})
        return found


def _is(event: dict, action: str, subsystem: str, devpath_end: str) -> bool:
    return (event["action"] == action and event["subsystem"] == subsystem
            and event["devpath"].endswith(devpath_end))


def step_uevents() -> None:
    """What the kernel announces on its uevent socket when a device binds to vfio-pci
    and unbinds, heard through katamgr.host.uevents (the device plugin's first source).

    The shared group's edu, free at this point, is bound and unbound with the writes
    katamgr makes (driver_override, drivers_probe, vfio-pci/unbind, driver_override
    cleared) and left as it was: no driver, no override, as step_not_viable expects.
    A DeviceWatcher on the real root is started too, to record whether it listens."""
    from katamgr.host.root import HostRoot
    from katamgr.host.uevents import open_kernel_events
    from sandbox_plugin.watch import DeviceWatcher

    bdf = STAND_INS["shared_edu"]
    data: dict = {"bdf": bdf, "group": group_of(bdf)}
    watcher = DeviceWatcher(HostRoot.at("/"), lambda: None)
    watcher.start()
    data["watcher_hears_uevents"] = watcher.hears_uevents
    watcher.stop()
    events = open_kernel_events()
    data["opened"] = events is not None
    if events is None:
        record("uevents", **data)
        return
    everything = _AllEvents()
    base = PCI / "devices" / bdf
    try:
        data["override"] = sysfs_write(base / "driver_override", "vfio-pci\n")
        data["probe"] = sysfs_write(PCI / "drivers_probe", bdf)
        data["driver_after_bind"] = driver_of(bdf)
        (data["bind_events"], data["all_bind_events"]), data["bind_heard_after_s"] = _collect(
            [events, everything], lambda got: any(_is(e, "bind", "pci", "/" + bdf) for e in got), 5)
        data["unbind"] = sysfs_write(PCI / "drivers" / "vfio-pci" / "unbind", bdf)
        data["undo_override"] = sysfs_write(base / "driver_override", "\n")
        data["driver_after_unbind"] = driver_of(bdf)
        data["override_after"] = read(base / "driver_override")
        (data["unbind_events"], data["all_unbind_events"]), data["unbind_heard_after_s"] = _collect(
            [events, everything], lambda got: any(_is(e, "unbind", "pci", "/" + bdf) for e in got), 5)
    finally:
        events.close()
    record("uevents", **data)


# ---- the bounded write -------------------------------------------------------------

PR_SET_CHILD_SUBREAPER = 36  # include/uapi/linux/prctl.h


def become_subreaper() -> bool:
    """Orphans below this process (katamgr's pending dd once katamgr has exited) are
    re-parented here rather than to init, so their exit status can be read (prctl(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def process_info(pid: int) -> dict:
    """What /proc says of a process: its argv, state (stat field 3), where it sleeps
    in the kernel (wchan; the stack where readable, root only)."""
    base = Path(f"/proc/{pid}")
    stat = read(base / "stat")
    return {"pid": pid, "exists": base.exists(),
            "cmdline": (read(base / "cmdline") or "").split("\0") if base.exists() else None,
            "state": stat.rsplit(")", 1)[1].split()[0] if stat else None,
            "wchan": read(base / "wchan"), "stack": read(base / "stack")}


def wait_reaped(pid: int, timeout: float) -> dict:
    """Until ``pid`` (our child or orphan) exits: its exit status and when."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not ours to reap: watch /proc instead
            done, status = (pid, None) if not Path(f"/proc/{pid}").exists() else (0, None)
        if done:
            code = os.waitstatus_to_exitcode(status) if status is not None else None
            return {"exited": True, "exit_code": code, "after_s": round(time.monotonic() - started, 2)}
        if time.monotonic() > deadline:
            return {"exited": False, "exit_code": None, "after_s": None}
        time.sleep(0.1)


def _unbind_traces(bdf: str, node: str) -> dict:
    """Where vfio-pci's hold on ``bdf`` shows: the ``driver`` link, vfio-pci's own link
    to it, the vfio-dev device under it, the group node. Not ``driver_override``:
    reading it waits for a pending unbind (see step_revert_forced)."""
    vfio_dev = PCI / "devices" / bdf / "vfio-dev"
    return {"driver": driver_of(bdf),
            "vfio_pci_link": (PCI / "drivers" / "vfio-pci" / bdf).is_symlink(),
            "vfio_dev": sorted(os.listdir(vfio_dev)) if vfio_dev.is_dir() else [],
            "group_node": os.path.exists(node)}


class Reader:
    """A command started while the unbind is pending, watched from outside: where it
    sleeps in the kernel, and when it ends relative to the holder's release.

    A thread of its own reads its output and reaps it, so the moment it ends is when
    it really ends (not when this script next looks), and a command that writes more
    than a pipe holds never waits for this script to read."""

    def __init__(self, argv: list[str], trace: Path | None = None) -> None:
        self.argv = argv
        self.trace = trace
        if trace is not None:
            # SIGUSR1 makes it write every thread's Python stack to ``trace``
            # (faulthandler): sent if it is still running when the holder lets go.
            argv = [sys.executable, "-c", _TRACED, str(trace), *argv]
        self.started, self.started_at = time.monotonic(), time.time()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.seen: dict | None = None
        self.samples: list[dict] = []
        self.threads: list[dict] = []
        self._last_wchan: str | None = None
        self._last_threads = 0.0
        self.ended: float | None = None
        self.ended_at: float | None = None
        self.output: tuple[str, str] = ("", "")
        self.done = threading.Event()
        threading.Thread(target=self._reap, daemon=True).start()

    def _reap(self) -> None:
        try:
            self.output = self.proc.communicate()
        finally:
            self.ended, self.ended_at = time.monotonic(), time.time()
            self.done.set()

    def sample_threads(self) -> None:
        """Every thread's state, wchan, CPU ticks (utime+stime) and kernel stack, about
        once a second, with the load: where it spends its time, running or asleep."""
        now = time.monotonic()
        if self.done.is_set() or now - self._last_threads < 1.0:
            return
        self._last_threads = now
        tasks = {}
        with contextlib.suppress(OSError):
            for task in sorted(Path(f"/proc/{self.proc.pid}/task").iterdir()):
                stat = read(task / "stat") or ""
                fields = stat.rsplit(")", 1)[1].split() if ")" in stat else []
                tasks[task.name] = {"state": fields[0] if fields else None,
                                    "ticks": int(fields[11]) + int(fields[12]) if len(fields) > 12 else None,
                                    "wchan": read(task / "wchan"), "stack": read(task / "stack")}
        self.threads.append({"after_s": round(now - self.started, 2), "loadavg": read(Path("/proc/loadavg")),
                             "tasks": tasks})
        del self.threads[:-60]

    def blocked_in_sysfs(self) -> bool:
        """Whether it sits in a sysfs attribute's handler (``dev_attr_show`` or
        ``dev_attr_store`` on its kernel stack) at two samples running, in the same
        function: a handler that does not wait returns in microseconds."""
        self.sample_threads()
        info = process_info(self.proc.pid)
        wchan, stack = info["wchan"] or "", info["stack"] or ""
        if not self.samples or self.samples[-1]["wchan"] != wchan:
            self.samples.append({"after_s": round(time.monotonic() - self.started, 2), "state": info["state"],
                                 "wchan": wchan})
            del self.samples[:-20]
        in_sysfs = "dev_attr_show" in stack or "dev_attr_store" in stack
        if in_sysfs and wchan and wchan == self._last_wchan:
            self.seen = info | {"after_s": round(time.monotonic() - self.started, 2)}
            return True
        self._last_wchan = wchan if in_sysfs else None
        return False

    def dump_if_running(self) -> None:
        """Ask a traced command still running for its Python stacks."""
        if self.trace is not None and not self.done.is_set():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGUSR1)

    def finish(self, released: float) -> dict:
        common = {"argv": self.argv, "seen_blocked": self.seen, "samples": self.samples, "threads": self.threads,
                  "released_after_s": round(released - self.started, 2)}
        if not self.done.wait(timeout=60):
            # Still blocked (unkillable while it waits for the device lock); leave it.
            return common | {"rc": None, "ended_after_release_s": None, "ended_before_release": False,
                             "traceback": self._traceback()}
        stdout, stderr = self.output
        with contextlib.suppress(ValueError):
            common["json"] = json.loads(stdout)
        return common | {
            "rc": self.proc.returncode, "stdout": stdout[-4000:], "stderr": stderr[-8000:],
            "seconds": round(self.ended - self.started, 2),
            "ended_after_release_s": round(self.ended - released, 2) if self.ended >= released else None,
            "ended_before_release": self.ended < released,
            "ended_before_release_s": round(released - self.ended, 2) if self.ended < released else None,
            "traceback": self._traceback(), **timing(self.started_at, stderr, self.ended_at)}

    def _traceback(self) -> str | None:
        return (read(self.trace) or None) if self.trace is not None else None


# A console script run with faulthandler answering SIGUSR1 into argv[1]:
# python -c _TRACED FILE SCRIPT ARGS...
_TRACED = """
import faulthandler, runpy, signal, sys
faulthandler.register(signal.SIGUSR1, file=open(sys.argv[1], "w"), all_threads=True)
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


UNBIND_FILE = str(PCI / "drivers" / "vfio-pci" / "unbind")


def pending_unbind_writer() -> int | None:
    """A process waiting in the kernel on a write to vfio-pci's unbind (katamgr's dd)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            cmdline = (read(entry / "cmdline") or "").split("\0")
            if f"of={UNBIND_FILE}" in cmdline and read(entry / "wchan") == "vfio_unregister_group_dev":
                return int(entry.name)
    return None


def start_readers(bdf: str) -> dict[str, Reader]:
    """While an unbind of ``bdf`` is pending: ``cat`` of its ``driver_override`` (the
    bare kernel fact: it waits for the device lock), and ``katamgr plan`` (what any
    katamgr command, the agent's reconcile or the plugin's rescan does first: read
    every device, the one being unbound included), which must not wait."""
    return {"cat": Reader(["cat", str(PCI / "devices" / bdf / "driver_override")]),
            "plan": Reader([KATAMGR, "plan", "--output", "json", *SELECTION, *LOGGING], trace=OUT / "plan-trace.txt")}


def watch_readers(readers: dict[str, Reader], writer: int, timeout: float) -> None:
    """Until each reader waits in a sysfs attribute or ends, the writer ends, or
    ``timeout``. The readers are left running: the holder's release frees them (a
    reader that waits for the unbind in some other way ends only after the release,
    which is what ``finish`` tells)."""
    deadline = time.monotonic() + timeout
    pending = dict(readers)
    while pending and time.monotonic() < deadline and Path(f"/proc/{writer}").exists():
        for name, reader in list(pending.items()):
            if reader.done.is_set() or reader.blocked_in_sysfs():
                del pending[name]
        time.sleep(0.2)


def step_revert_forced(holder: NestedQemu | None) -> None:
    """``katamgr revert --force`` while the nested QEMU still holds the edu's group:
    the unbind is written all the same, through katamgr's bounded writer (a dd child),
    and the kernel holds it. The revert must return within the bound (10 s) naming the
    pending writer; then the QEMU is stopped and the pending unbind must complete.
    While it is pending, two readers (``start_readers``) show what else waits for it."""
    if holder is None or holder.proc.poll() is not None:
        record("revert_forced", error="no nested QEMU holds a group (see nested_qemu)")
        return
    bdf = holder.bdf
    node = f"/dev/vfio/{group_of(bdf)}"
    data: dict = {"holder_pid": holder.proc.pid, "holder_node": node, "holder_bdf": bdf,
                  "held_before": holder.holds(node), "subreaper": become_subreaper()}
    lines_before = len(dmesg())
    started, started_at = time.monotonic(), time.time()
    argv = [KATAMGR, "revert", "--force", *LOGGING]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    # katamgr's start-up under TCG is seconds; this bound is far past start-up, the
    # 10 s write bound and its margin, and is only there so a hang ends.
    deadline = started + 120
    readers: dict[str, Reader] = {}
    timed_out = False
    while True:
        try:
            stdout, stderr = proc.communicate(timeout=0.25)  # retrying loses no output
            break
        except subprocess.TimeoutExpired:
            for reader in readers.values():
                reader.sample_threads()
            if not readers and pending_unbind_writer():
                # The write is pending: the readers' start-up overlaps the rest of the bound.
                readers = start_readers(bdf)
                data["readers_started_after_s"] = round(time.monotonic() - started, 2)
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate(timeout=10)
                timed_out = True
                break
    data.update(argv=argv, rc=proc.returncode, stdout=stdout, stderr=stderr, timed_out=timed_out,
                seconds=round(time.monotonic() - started, 2), **timing(started_at, stderr))
    exited_at = time.monotonic()
    data["at_exit"] = _unbind_traces(bdf, node)
    data["held_at_exit"] = holder.holds(node)
    match = re.search(r"pending in process (\d+)", data["stdout"] + data["stderr"])
    pid = int(match.group(1)) if match else None
    data["pending_pid"] = pid
    data["pending_at_exit"] = process_info(pid) if pid else None
    data["dmesg_while_pending"] = dmesg()[lines_before:]
    if pid:
        readers = readers or start_readers(bdf)
        watch_readers(readers, pid, timeout=45)
    for reader in readers.values():
        reader.dump_if_running()
    data["holder_stopped_after_exit_s"] = round(time.monotonic() - exited_at, 2)
    # The release: the moment the holder is killed. Its exit frees the group, and
    # with it the pending unbind and whatever waits for the device lock, before
    # stop() returns; the readers' ends are timed against this moment.
    released = time.monotonic()
    data["holder_rc"] = holder.stop()
    if pid:
        # after_s: from the holder's end to the writer's.
        data["pending_end"] = wait_reaped(pid, timeout=30)
    data["readers"] = {name: reader.finish(released) for name, reader in readers.items()}
    # What is left of vfio-pci's hold once the unbind has completed (bounded: the
    # group node goes last, when vfio_unregister_group_dev returns).
    deadline = time.monotonic() + 30
    while os.path.exists(node) and time.monotonic() < deadline:
        time.sleep(0.1)
    data["after_release"] = _unbind_traces(bdf, node)
    data["after_release"]["driver_override"] = read(PCI / "devices" / bdf / "driver_override")
    data["dmesg"] = dmesg()[lines_before:]
    data["after"] = snapshot()
    record("revert_forced", **data)


def main() -> int:
    save()
    # Imported while the first commands run, on the guest's other CPU.
    threading.Thread(target=_guarded, args=(import_kubelet_simulator,), daemon=True).start()
    STAND_INS.update(find_stand_ins())
    for step in (step_facts, step_original_drivers,
                 lambda: katamgr("plan", ["plan", "--output", "json", *SELECTION]),
                 lambda: katamgr("apply", ["apply", *SELECTION])):
        _guarded(step)
    plugin = _guarded(Plugin)
    _guarded(lambda: katamgr("apply_again", ["apply", *SELECTION]))
    _guarded(lambda: step_plugin(plugin))
    _guarded(step_uevents)
    holder = _guarded(step_nested_qemu)
    _guarded(step_not_viable)
    _guarded(lambda: step_revert_while_held(holder))
    _guarded(lambda: step_revert_forced(holder))
    if holder is not None:
        holder.stop()
    _guarded(lambda: katamgr("revert", ["revert"]))
    _guarded(lambda: guest_health.step_health(OUT, record, katamgr, PLUGIN, STAND_INS))
    results["dmesg"] = dmesg_tail(200)
    results["finished"] = True
    results["seconds"] = round(time.time() - results["started"], 1)
    save()
    return 0


def _guarded(step):
    try:
        return step()
    except Exception:  # noqa: BLE001 - one broken step must not hide the others
        name = getattr(step, "__name__", "step")
        results.setdefault("errors", []).append(f"{name}: {traceback.format_exc()}")
        save()
        print(traceback.format_exc(), flush=True)
        return None


if __name__ == "__main__":
    sys.exit(main())
