"""Write points, for the crash-safety sweep (``bench/reliability.py``, its crash points).

Every step that changes the host calls ``write_point(label)`` just before it acts.
In normal runs that is a no-op. With ``KATAMGR_CRASH_AT=N`` in the environment the
process kills itself with SIGKILL at its N-th write point, as a power cut or an OOM
kill would; with ``KATAMGR_WRITE_POINTS=FILE`` each label is appended to FILE, so
the sweep knows how many points a run has. That is how the tests prove that a kill
at any step of ``apply`` or ``revert``, followed by either command, converges. With
``KATAMGR_FAIL_AT=N:EROFS`` (or ``N:ENOSPC``) the N-th write fails instead, as a directory
made read-only or a full disk after the checks would make it: the run must then say what it
kept and how to undo it, never crash. With ``KATAMGR_PAUSE_AT=N:SECONDS`` the N-th write point
waits that long first, so a test can send SIGINT or SIGTERM while that step is under way.
"""

from __future__ import annotations

import errno
import os
import signal
import time

CRASH_AT = "KATAMGR_CRASH_AT"
FAIL_AT = "KATAMGR_FAIL_AT"
WRITE_LOG = "KATAMGR_WRITE_POINTS"
PAUSE_AT = "KATAMGR_PAUSE_AT"

_seen = 0


def write_point(label: str) -> None:
    global _seen
    crash_at = os.environ.get(CRASH_AT)
    fail_at = os.environ.get(FAIL_AT)
    log = os.environ.get(WRITE_LOG)
    pause_at = os.environ.get(PAUSE_AT)
    if not crash_at and not log and not fail_at and not pause_at:
        return
    _seen += 1
    if log:
        with open(log, "a") as out:
            out.write(f"{_seen} {label}\n")
    if pause_at and _seen == int(pause_at.split(":", 1)[0]):
        time.sleep(float(pause_at.split(":", 1)[1]))  # a signal's handler runs, the sleep goes on
    if crash_at and _seen == int(crash_at):
        os.kill(os.getpid(), signal.SIGKILL)
    if fail_at:
        point, name = fail_at.split(":", 1)
        if _seen == int(point):
            code = getattr(errno, name)
            raise OSError(code, os.strerror(code), label.split(" ", 1)[-1])
