"""What both long-running commands (``katamgr``, ``sandbox-device-plugin``) do as
processes on the node: one log format on stderr, and a clean stop on SIGTERM/SIGINT
(the kubelet's way of ending a DaemonSet pod, and Ctrl-C's).

It sits in ``katamgr.host`` because that is the layer the device plugin imports.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def setup_logging(level: int) -> None:
    """Log records at ``level`` and above to stderr, in the format both commands share."""
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)


def stop_on_signals(stop: Callable[[], None], log: logging.Logger) -> bool:
    """Call ``stop()`` on SIGTERM or SIGINT, saying so in ``log``.

    Python runs signal handlers in the main thread only, so off it nothing is
    installed and False is returned (a test running a loop in a thread stops it
    itself).
    """
    if threading.current_thread() is not threading.main_thread():
        return False

    def handler(signum: int, _frame: object) -> None:
        log.info("received %s: stopping", signal.Signals(signum).name)
        stop()

    for signum in STOP_SIGNALS:
        signal.signal(signum, handler)
    return True
