"""What both long-running commands (``katamgr``, ``sandbox-device-plugin``) do as
processes on the node: one log format on stderr (``--log-format text``, the default, or
``json``: one object per line for log collectors), and a clean stop on SIGTERM/SIGINT
(the kubelet's way of ending a DaemonSet pod, and Ctrl-C's).

It sits in ``gpunode.services`` (the services both programs share) because the device plugin imports it too.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
TEXT, JSON = "text", "json"
LOG_FORMATS = (TEXT, JSON)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: ``time`` (RFC 3339, UTC, milliseconds),
    ``level``, ``logger``, ``message``, and ``exception`` (the formatted traceback) or
    ``stack`` when the record carries one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        return f"{seconds}.{int(record.msecs):03d}Z"


# The distribution all three programs ship in (katamgr, sandbox-device-plugin, sandbox-dra-driver).
DISTRIBUTION = "kata-sandbox-manager"


def package_version() -> str:
    """The installed distribution's version (what pip or the image installed), or the
    source tree's when it runs uninstalled."""
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        from gpunode import __version__

        return __version__


class VersionAction(argparse.Action):
    # argparse's own "version" action wants the text when the parser is built; this one
    # reads the package metadata only when --version is asked for.
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):  # noqa: A002
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog} {package_version()}")
        parser.exit()


def setup_logging(level: int, log_format: str = TEXT) -> None:
    """Log records at ``level`` and above to stderr, in the format both commands share
    (``text``) or as JSON lines (``json``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == JSON else logging.Formatter(LOG_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])


def report_error(message: str, log_format: str, logger: logging.Logger, *, exc_info: bool = False) -> None:
    """A command's last word on stderr: the plain sentence (``text``), or an ERROR record
    of ``logger`` so that a JSON log stays one object per line (``json``)."""
    if log_format == JSON:
        logger.error("%s", message, exc_info=exc_info)
        return
    if exc_info:
        traceback.print_exc()
    print(message, file=sys.stderr)


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


class _ClosedReaderSafe:
    """A standard stream whose reader may go away: ``katamgr apply | head -1`` closes the pipe
    after one line, and Python (which ignores SIGPIPE) raises BrokenPipeError on the next
    write. The work must go on and keep its exit code, so once the reader is gone the
    stream's descriptor is pointed at /dev/null (the interpreter's flush at exit then has
    nowhere to fail) and what would have been written is dropped."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (BrokenPipeError, ValueError, OSError) as exc:
            self._gone(exc)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (BrokenPipeError, ValueError, OSError) as exc:
            self._gone(exc)

    def _gone(self, exc: Exception) -> None:
        if isinstance(exc, OSError) and not isinstance(exc, BrokenPipeError) and exc.errno not in (
                errno.EPIPE, errno.ECONNRESET, errno.EINVAL):
            return  # another write error on a terminal or file: dropped too, never fatal
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def guard_std_streams() -> None:
    """Make stdout and stderr safe from a reader that goes away (see ``_ClosedReaderSafe``)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _ClosedReaderSafe):
            setattr(sys, name, _ClosedReaderSafe(stream))
