"""The webhook's worker threads: a fixed number, started once, taking the smallest review
first.

Reviewing is pure CPU (parsing the body, the rules), so its cost grows with the body. Taken
in arrival order, a few 3 MiB bodies from one client would hold up the API server's
reviews of a few kilobytes behind them for as long as they take; taken smallest first, the
usual review waits at most for the one being parsed. (A large review still gets its turn:
the bodies queued are bounded by the server's byte budget.)
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("katamgr.webhook")

Job = Callable[[], Any]
Done = Callable[[Any, BaseException | None], None]


class Workers:
    def __init__(self, count: int, name: str = "webhook-review") -> None:
        # (size, sequence, job, done); a None job tells a thread to end.
        self._queue: queue.PriorityQueue[tuple[int, int, Job | None, Done | None]] = queue.PriorityQueue()
        self._sequence = itertools.count()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(count)]
        for thread in self._threads:
            thread.start()

    def submit(self, size: int, job: Job, done: Done) -> None:
        """Run ``job`` in a worker, smallest ``size`` first; then ``done(result, error)``
        in that worker."""
        self._queue.put((size, next(self._sequence), job, done))

    def stop(self) -> None:
        """End the threads once they finish what they are doing (queued jobs are dropped)."""
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
        for _ in self._threads:
            self._queue.put((-1, next(self._sequence), None, None))

    def _run(self) -> None:
        while True:
            _, _, job, done = self._queue.get()
            if job is None or done is None:
                return
            try:
                result = job()
            except BaseException as exc:  # noqa: BLE001 - handed to the loop, which answers 500
                done(None, exc)
            else:
                done(result, None)
