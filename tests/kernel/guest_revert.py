"""The real-kernel suite's forced revert, guest side: an unbind the kernel holds while a VM
keeps the device, and the bounded write that must not hang katamgr (``guest_checks.py``
runs it)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from guest_common import (
    KATAMGR,
    LOGGING,
    OUT,
    PCI,
    SELECTION,
    NestedQemu,
    dmesg,
    driver_of,
    group_of,
    read,
    record,
    snapshot,
    timing,
)

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


