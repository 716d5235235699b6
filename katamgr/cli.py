"""The ``katamgr`` command."""

from __future__ import annotations

import logging
import sys

from gpunode.errors import ConfigError, GpuNodeError
from gpunode.services import interrupt
from gpunode.services.process import (
    TEXT,
    guard_std_streams,
    report_error,
    setup_logging,
)
from katamgr.commands.parser import build_parser

log = logging.getLogger("katamgr")

# The commands that stop at a safe point on SIGINT/SIGTERM and say what was done (``run``
# and ``webhook`` stop their loops themselves; the rest change nothing).
STOPPED_AT_SAFE_POINTS = ("plan", "apply", "revert", "status")


def exit_code_of(exc: BaseException) -> int | None:
    """The exit code of an error raised on purpose, whose message says it all (2: bad usage
    or configuration, nothing was changed; 1: a failure); None for anything else (a bug)."""
    if isinstance(exc, FileExistsError):  # a non-empty --into
        return ConfigError.exit_code
    if isinstance(exc, GpuNodeError):  # HostError and ProfileError included
        return exc.exit_code
    return None


def main(argv: list[str] | None = None) -> int:
    # A reader that goes away (`katamgr apply | head -1`) must not stop the work half-way:
    # what is written after it went is dropped, and the exit code stays the work's.
    guard_std_streams()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "help":
        # `katamgr help plan` is `katamgr plan --help`; `katamgr help` is `katamgr --help`.
        parser.parse_args([args.topic, "--help"] if args.topic else ["--help"])
    log_format = getattr(args, "log_format", TEXT)
    setup_logging(logging.INFO if args.verbose else logging.WARNING, log_format)
    if not args.verbose:
        # urllib3 logs each retry of an unanswered API call as a warning; the command says
        # what the API server's silence means once, in its own words.
        logging.getLogger("urllib3").setLevel(logging.ERROR)
    try:
        if args.command not in STOPPED_AT_SAFE_POINTS:
            return args.func(args)
        with interrupt.handled():
            return args.func(args)
    except KeyboardInterrupt as exc:
        code = exc.exit_code if isinstance(exc, interrupt.Interrupted) else 130
        name = exc.name if isinstance(exc, interrupt.Interrupted) else "SIGINT"
        # Out here only before the first write (a run under way reports what it did itself).
        return _fail(args, f"katamgr: stopped by {name} before any change; nothing was changed", code,
                     log_format)
    except Exception as exc:  # noqa: BLE001 - every error ends here: one sentence and an exit code
        code = exit_code_of(exc)
        if code is not None:
            return _fail(args, f"katamgr: {exc}", code, log_format)
        report_error(f"katamgr: unexpected {type(exc).__name__}: {exc} (run with -v for the traceback; "
                     f"please report it)", log_format, log, exc_info=getattr(args, "verbose", False))
        _error_document(args, f"unexpected {type(exc).__name__}: {exc}", 1)
        return 1


def _fail(args, message: str, code: int, log_format: str) -> int:
    report_error(message, log_format, log)
    _error_document(args, message.removeprefix("katamgr: "), code)
    return code


def _error_document(args, message: str, code: int) -> None:
    """With ``-o json``/``-o yaml``, the failure as a document on stdout too: a script reads one
    document whatever happened."""
    fmt = getattr(args, "output", None)
    from katamgr.output.documents import FORMATS, dump, error_document

    if fmt in FORMATS:
        print(dump(error_document(args.command, message, code), fmt))


if __name__ == "__main__":
    sys.exit(main())
