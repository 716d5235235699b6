"""Write points, for the crash-safety sweep (``bench/reliability.py``, its crash points).

Every step that changes the host calls ``write_point(label)`` just before it acts.
In normal runs that is a no-op. With ``KATAMGR_CRASH_AT=N`` in the environment the
process kills itself with SIGKILL at its N-th write point, as a power cut or an OOM
kill would; with ``KATAMGR_WRITE_POINTS=FILE`` each label is appended to FILE, so
the sweep knows how many points a run has. That is how the tests prove that a kill
at any step of ``apply`` or ``revert``, followed by either command, converges.
"""

from __future__ import annotations

import os
import signal

CRASH_AT = "KATAMGR_CRASH_AT"
WRITE_LOG = "KATAMGR_WRITE_POINTS"

_seen = 0


def write_point(label: str) -> None:
    global _seen
    crash_at = os.environ.get(CRASH_AT)
    log = os.environ.get(WRITE_LOG)
    if not crash_at and not log:
        return
    _seen += 1
    if log:
        with open(log, "a") as out:
            out.write(f"{_seen} {label}\n")
    if crash_at and _seen == int(crash_at):
        os.kill(os.getpid(), signal.SIGKILL)
