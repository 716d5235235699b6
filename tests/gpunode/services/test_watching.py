"""The one wait every loop uses: inotify events, a wake-up from another thread, or a timeout."""

from __future__ import annotations

import os
import select
import threading
import time

from inotify_simple import flags

from gpunode.services.watching import Watcher


def test_events_wake_up_and_timeout(tmp_path):
    watcher = Watcher()
    try:
        watcher.add_watch(tmp_path, flags.CREATE)
        assert watcher.wait(0.01) == []  # nothing happened

        (tmp_path / "a").write_text("x")
        events = watcher.wait(5)
        assert [e.name for e in events] == ["a"]

        # A burst is read whole: the rest of it comes with settle().
        for name in "bcd":
            (tmp_path / name).write_text("x")
        events = watcher.wait(5) + watcher.settle(0.05, 1)
        assert sorted(e.name for e in events) == ["b", "c", "d"]

        started = time.monotonic()
        threading.Timer(0.05, watcher.wake).start()
        assert watcher.wait(10) is None  # woken, long before the timeout
        assert time.monotonic() - started < 5
        assert watcher.wait(0.01) == []  # and the wake-up was used up
    finally:
        watcher.close()
    watcher.wake()  # harmless once closed (a stop request racing the loop's end)
    watcher.close()


def test_a_watcher_closed_while_woken_reads_no_descriptor_it_no_longer_owns(monkeypatch):
    """A stop gives up waiting for a busy loop (a bounded join) and closes its watcher while
    the loop's wait is returning from a wake-up. The closed numbers are free for the process's
    next socket or file; the wait must read none of them (it once drained "its" wake pipe and
    took another connection's bytes)."""
    watcher = Watcher()
    other_r, other_w = os.pipe()  # stands in for a socket opened meanwhile
    os.set_blocking(other_r, False)
    os.write(other_w, b"someone else's bytes")
    reused: list[int] = []
    real_select = select.select

    def closed_meanwhile(r, w, x, timeout):
        ready = real_select(r, w, x, timeout)
        watcher.close()
        for fd in ready[0]:  # the kernel hands the freed numbers out again
            os.dup2(other_r, fd)
            reused.append(fd)
        return ready

    watcher.wake()
    monkeypatch.setattr(select, "select", closed_meanwhile)
    try:
        assert watcher.wait(1) is None
        assert reused, "the wake-up was not ready"
        assert os.read(other_r, 100) == b"someone else's bytes"
    finally:
        for fd in (*reused, other_r, other_w):
            os.close(fd)
