"""inotify on the kubelet's device-plugins dir, for the registration supervisor
(``sandbox_plugin.server``): a wait for a change to named files, cut short by ``wake()``,
and the dir watched afresh when it is removed or moved."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from inotify_simple import flags as inotify_flags

from gpunode.services.watching import Watcher

log = logging.getLogger(__name__)


class DirWatcher:
    """inotify on the device-plugins dir; ``wake()`` (from stop()) cuts a wait short."""

    MASK = (
        inotify_flags.CREATE
        | inotify_flags.DELETE
        | inotify_flags.MOVED_FROM
        | inotify_flags.MOVED_TO
        | inotify_flags.DELETE_SELF
        | inotify_flags.MOVE_SELF
    )

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._watcher = Watcher()
        self._watch()

    def _watch(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._watcher.add_watch(self.directory, self.MASK)

    def wait(self, timeout: float, names: frozenset[str]) -> bool:
        """Wait up to ``timeout`` s for an event on one of ``names`` (or on the dir
        itself); return True when one came, False on timeout or wake()."""
        remaining = timeout
        deadline = time.monotonic() + timeout
        while remaining > 0:
            events = self._watcher.wait(remaining)
            if events is None:  # wake()
                return False
            relevant = False
            for event in events:
                if event.mask & (inotify_flags.DELETE_SELF | inotify_flags.MOVE_SELF):
                    log.warning("%s was removed or moved; watching it afresh", self.directory)
                    self._watch()
                    relevant = True
                elif event.name in names:
                    relevant = True
            if relevant:
                return True
            remaining = deadline - time.monotonic()
        return False

    def wake(self) -> None:
        self._watcher.wake()

    def close(self) -> None:
        self._watcher.close()
