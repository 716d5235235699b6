"""The one wait every loop uses: inotify events, a wake-up from another thread, or a timeout."""

from __future__ import annotations

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
