"""The real-kernel suite's health checks, guest side (called by guest_checks.py's ``main``).

Two virtio-rng devices (1af4:1044, each behind its own ``pcie-root-port``, with AER; the
second without FLR; tests/support/kernelvm.py ``Topology``) are bound to vfio-pci by katamgr
and served by the device plugin (its own process, ``--include-device
1af4:1044=example.com/rng``) to the kubelet simulator in this process. Then, while the plugin
runs:

- the host's QEMU monitor injects AER errors into the first one (``pcie_aer_inject_error``:
  correctable, non-fatal, fatal), asked for through the share (``ask``; the host side is
  tests/support/guestmonitor.py). The kernel's AER driver counts them in the device's
  ``aer_dev_*`` files and recovers the device (drivers/pci/pcie/err.c); what the kubelet
  is told, and when, is recorded;
- an operator turns its reset methods off (``reset_method`` written empty) and back
  (``default``);
- the second one, held by a pod, is hot-unplugged (QMP ``device_del``; the guest's acpiphp
  removes it).

A device sends an error message only when Device Control's reporting enable for its severity
is set (CERE, NFERE, FERE, URRE; QEMU: hw/pci/pcie_aer.c, ``pcie_aer_msg_alldev``). Linux
sets them when the AER driver binds the root port (6.1: ``set_downstream_devices_error_reporting``)
or, from 6.4, at every device's enumeration; ``enable_error_reporting`` records what the
guest's kernel left there and sets them if it did not (a device added later, on 6.1).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

PCI = Path("/sys/bus/pci")
RNG = "1af4:1044"
RNG_RESOURCE = "example.com/rng"
SELECTION = ["--include-device", f"{RNG}={RNG_RESOURCE}"]
AER_DEVICE, UNPLUGGED_DEVICE = "aer-rng", "unplugged-rng"  # kernelvm's QEMU ids
_asked = 0


def ask(out: Path, request: dict, timeout: float = 30.0) -> dict:
    """One monitor request to the host, answered within ``timeout`` (else an error)."""
    global _asked
    _asked += 1
    directory = out / "monitor"
    directory.mkdir(exist_ok=True)
    tmp = directory / f"{_asked:03d}.tmp"
    tmp.write_text(json.dumps(request))
    os.replace(tmp, directory / f"{_asked:03d}.request")
    answer = directory / f"{_asked:03d}.answer"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return json.loads(answer.read_text())
        except (OSError, ValueError):
            time.sleep(0.01)
    return {"ok": False, "error": f"no answer from the host within {timeout:g} s"}


def devices() -> list[str]:
    """The virtio-rng devices in bus order: the AER one (rp4) first, then the one unplugged."""
    found = []
    for bdf in sorted(os.listdir(PCI / "devices")):
        ids = [(PCI / "devices" / bdf / n).read_text().strip()[2:] for n in ("vendor", "device")]
        if ":".join(ids) == RNG:
            found.append(bdf)
    return found


def enable_error_reporting(bdf: str) -> dict:
    """Set Device Control's four error reporting enables, found through the capability list."""
    path = PCI / "devices" / bdf / "config"
    fd = os.open(path, os.O_RDWR)
    try:
        config = os.pread(fd, 256, 0)
        at, seen = config[0x34] & ~3, 0
        while at and seen < 48:
            if config[at] == 0x10:  # PCI Express capability
                devctl = at + 8
                before = int.from_bytes(config[devctl:devctl + 2], "little")
                os.pwrite(fd, (before | 0xF).to_bytes(2, "little"), devctl)
                after = int.from_bytes(os.pread(fd, 2, devctl), "little")
                return {"devctl_before": hex(before), "devctl_after": hex(after)}
            at, seen = config[at + 1] & ~3, seen + 1
        return {"error": "no PCI Express capability"}
    finally:
        os.close(fd)


def aer_files(bdf: str) -> dict[str, str | None]:
    out = {}
    for name in ("aer_dev_correctable", "aer_dev_nonfatal", "aer_dev_fatal"):
        try:
            out[name] = (PCI / "devices" / bdf / name).read_text()
        except OSError:
            out[name] = None
    return out


def facts(bdf: str) -> dict:
    """Our host facts module's reading, and the rule's verdict, on the real sysfs."""
    from gpunode.host import pcihealth
    from gpunode.host.root import HostRoot
    from gpunode.policy.health import HealthPolicy

    found = pcihealth.read_health(HostRoot.at("/"), bdf)
    return {"summary": found.summary(), "resettable": found.resettable, "reset_methods": found.reset_methods,
            "off_bus": found.off_bus, "aer": None if found.aer is None else
            [found.aer.correctable, found.aer.nonfatal, found.aer.fatal],
            "problems": [[p.reason, p.message, p.fatal] for p in HealthPolicy().problems(found, None)]}


def _health(kubelet, bdf: str) -> str | None:
    return next((d.health for d in kubelet.state.devices.get(RNG_RESOURCE, []) if d.id == bdf), None)


def _until(kubelet, bdf: str, value: str | None, started: float, timeout: float = 10.0) -> float | None:
    """Seconds from ``started`` to the first ListAndWatch update listing ``bdf`` as ``value``
    (the simulator's history: a short Unhealthy is one the kubelet acts on too)."""
    def seen(state) -> float | None:
        return next((at for at, name, devices in state.history
                     if at >= started and name == RNG_RESOURCE and (bdf, value) in devices), None)
    try:
        state = kubelet.wait_for(lambda s: seen(s) is not None, timeout=timeout)
    except TimeoutError:
        return None
    return round(seen(state) - started, 3)


def _total(bdf: str, name: str) -> int | None:
    text = aer_files(bdf).get(name) or ""
    return next((int(line.split()[1]) for line in text.splitlines() if line.startswith("TOTAL_ERR_")), None)


def inject(out: Path, kubelet, bdf: str, kind: str, hmp: str) -> dict:
    """One AER error: how long until the kubelet heard Unhealthy, and Healthy again."""
    name = {"correctable": "aer_dev_correctable", "nonfatal": "aer_dev_nonfatal", "fatal": "aer_dev_fatal"}[kind]
    before = _total(bdf, name)
    started = time.monotonic()
    answer = ask(out, {"hmp": hmp})
    entry: dict = {"kind": kind, "hmp": hmp, "answer": answer, "total_before": before}
    if kind == "correctable":
        deadline = time.monotonic() + 5
        while _total(bdf, name) == before and time.monotonic() < deadline:
            time.sleep(0.01)
        entry["counted_s"] = round(time.monotonic() - started, 3)
        time.sleep(1.5)  # three polls of the plugin's
        entry["health_after"] = _health(kubelet, bdf)
    else:
        entry["unhealthy_s"] = _until(kubelet, bdf, "Unhealthy", started)
        entry["reason"] = _reason(out, bdf)
        if kind == "fatal":
            # The kernel's own recovery fails here (the root port's reset: ENOTTY under QEMU);
            # the hand-back check (a reset through sysfs, read back) is what brings it back.
            time.sleep(0.5)
            entry["hand_back"] = hand_back(bdf)
        # Healthy again after that Unhealthy (an update listing it Healthy before it does not count).
        turned = started + (entry["unhealthy_s"] or 0.0)
        again = _until(kubelet, bdf, "Healthy", turned)
        entry["healthy_again_s"] = None if again is None else round(again + (entry["unhealthy_s"] or 0.0), 3)
    entry["total_after"] = _total(bdf, name)
    return entry


def hand_back(bdf: str) -> dict:
    """katamgr's hand-back check on the real kernel (what the agent runs), its verdict written
    where the plugin reads it."""
    from gpunode.host import handback
    from gpunode.host.root import HostRoot
    from gpunode.policy.health import HealthPolicy

    host = HostRoot.at("/")
    verdict = HealthPolicy().hand_back(host, bdf, None)
    if verdict is not None:
        handback.write_verdict(host, verdict)
    return None if verdict is None else {"ok": verdict.ok, "reason": verdict.reason, "reset": verdict.reset,
                                         "seconds": round(verdict.seconds, 3)}


def _reason(out: Path, bdf: str) -> str | None:
    """The reason the plugin logged for the device's last turn to Unhealthy."""
    try:
        lines = (out / "health-plugin.log").read_text(errors="replace").splitlines()
    except OSError:
        return None
    return next((line.split("is now Unhealthy", 1)[1].strip(" ()") for line in reversed(lines)
                 if f"device {bdf} is now Unhealthy" in line), None)


def step_health(out: Path, record, katamgr, plugin_bin: str, stand_ins: dict) -> None:
    from gpunode.host.root import HostRoot
    from nodesim.kubelet import KubeletSimulator

    data: dict = {}
    found = devices()
    data["devices"] = found
    if len(found) != 2:
        record("health", error=f"expected two virtio-rng devices, found {found}")
        return
    aer_dev, unplugged = found
    katamgr("health_apply", ["apply", *SELECTION])
    data["legacy_nic"] = facts(stand_ins["nic"]) if stand_ins.get("nic") else None
    data["reporting"] = {bdf: enable_error_reporting(bdf) for bdf in found}
    data["facts_before"] = {bdf: facts(bdf) for bdf in found}
    data["aer_files_before"] = aer_files(aer_dev)
    log_path = out / "health-plugin.log"
    with open(log_path, "w") as log:
        plugin = subprocess.Popen([plugin_bin, "--mode", "vm-passthrough", *SELECTION, "-v"],
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    data["facts_bound"] = {bdf: facts(bdf) for bdf in found}
    kubelet = KubeletSimulator(HostRoot.at("/"))
    kubelet.start()
    try:
        kubelet.wait_for(lambda s: len(s.healthy(RNG_RESOURCE)) == 2, timeout=120)
        data["listed"] = {bdf: _health(kubelet, bdf) for bdf in found}
        time.sleep(1.0)  # the watcher starts right after the first scan
        injections = [inject(out, kubelet, aer_dev, "correctable", f"pcie_aer_inject_error -c {AER_DEVICE} 0x40")]
        injections += [inject(out, kubelet, aer_dev, "nonfatal", f"pcie_aer_inject_error {AER_DEVICE} UNSUP")
                       for _ in range(3)]
        # One: after its failed recovery QEMU's root port sends no second fatal message.
        injections.append(inject(out, kubelet, aer_dev, "fatal", f"pcie_aer_inject_error {AER_DEVICE} DLP"))
        data["rootport_fatal"] = (PCI / "devices" / aer_dev / ".." / "aer_rootport_total_err_fatal").read_text().strip() \
            if (PCI / "devices" / aer_dev / ".." / "aer_rootport_total_err_fatal").exists() else None
        data["injections"] = injections
        times = [i["unhealthy_s"] for i in injections if i.get("unhealthy_s") is not None]
        data["unhealthy_p50_s"] = statistics.median(times) if times else None
        data["aer_files_after"] = aer_files(aer_dev)
        data["facts_after"] = facts(aer_dev)
        # An operator turns the device's reset methods off, then back to the kernel's defaults.
        methods = PCI / "devices" / aer_dev / "reset_method"
        started = time.monotonic()
        methods.write_text("\n")
        data["reset_off"] = {"read_back": methods.read_text(), "unhealthy_s": _until(kubelet, aer_dev, "Unhealthy", started),
                             "reason": facts(aer_dev)["problems"]}
        started = time.monotonic()
        methods.write_text("default\n")
        data["reset_default"] = {"read_back": methods.read_text(),
                                 "healthy_s": _until(kubelet, aer_dev, "Healthy", started)}
        # Hot-unplug of a device a pod holds.
        kubelet.admit_pod("default", "vm-rngs", {"vm": {RNG_RESOURCE: 2}})
        started = time.monotonic()
        answer = ask(out, {"qmp": {"execute": "device_del", "arguments": {"id": UNPLUGGED_DEVICE}}})
        deadline = time.monotonic() + 15
        while (PCI / "devices" / unplugged).exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        removed = time.monotonic()
        data["unplug"] = {"answer": answer, "removed": not (PCI / "devices" / unplugged).exists(),
                          "removed_s": round(removed - started, 3),
                          "unhealthy_after_removal_s": _until(kubelet, unplugged, "Unhealthy", removed),
                          "facts": facts(unplugged)}
        kubelet.remove_pod("default", "vm-rngs")
    except Exception as exc:  # noqa: BLE001 - recorded for the host-side tests to show
        data["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        plugin.terminate()
        try:
            data["plugin_rc"] = plugin.wait(timeout=20)
        except subprocess.TimeoutExpired:
            plugin.kill()
            data["plugin_rc"] = "killed"
        kubelet.stop()
        data["plugin_log"] = log_path.read_text(errors="replace")[-20000:]
    data["dmesg"] = [line for line in subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30,
                                                     check=False).stdout.splitlines()
                     if any(w in line for w in ("AER", "aer", aer_dev, unplugged))][-80:]
    record("health", **data)
    katamgr("health_revert", ["revert"])
