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

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import guest_health  # beside this script (its directory is first on sys.path)
from guest_common import (
    EDU_RESOURCE,
    KATAMGR,
    LOGGING,
    OUT,
    PCI,
    PLUGIN,
    SELECTION,
    STAND_INS,
    VGA_RESOURCE,
    NestedQemu,
    dmesg,
    dmesg_tail,
    driver_of,
    find_stand_ins,
    group_of,
    groups,
    read,
    record,
    results,
    run,
    save,
    snapshot,
    sysfs_write,
    timing,
    unbind_waits,
)
from guest_revert import step_revert_forced
from guest_uevents import step_uevents, uevent_sockets

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


def katamgr(name: str, args: list[str], timeout: float = 180) -> dict:
    started_at = time.time()
    result = run([KATAMGR, *args, *LOGGING], timeout)
    result.update(timing(started_at, result["stderr"]), after=snapshot())
    # plan exits 4 when it lists problems (katamgr/exitcodes.py), its document printed all the same
    if args[:1] == ["plan"] and "--output" in args and result["rc"] in (0, 4):
        with contextlib.suppress(ValueError):
            result["json"] = json.loads(result["stdout"])
    return record(name, **result)


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
    from gpunode.host.root import HostRoot

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
    from gpunode.host.root import HostRoot
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
