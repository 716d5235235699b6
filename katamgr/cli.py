"""The ``katamgr`` command."""

from __future__ import annotations

import logging
import sys

from gpunode.errors import ConfigError, GpuNodeError
from gpunode.services.process import (
    TEXT,
    report_error,
    setup_logging,
)
from katamgr.commands.parser import build_parser

log = logging.getLogger("katamgr")


def exit_code_of(exc: BaseException) -> int | None:
    """The exit code of an error raised on purpose, whose message says it all (2: bad usage
    or configuration, nothing was changed; 1: a failure); None for anything else (a bug)."""
    if isinstance(exc, FileExistsError):  # a non-empty --into
        return ConfigError.exit_code
    if isinstance(exc, GpuNodeError):  # HostError and ProfileError included
        return exc.exit_code
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "help":
        # `katamgr help plan` is `katamgr plan --help`; `katamgr help` is `katamgr --help`.
        parser.parse_args([args.topic, "--help"] if args.topic else ["--help"])
    log_format = getattr(args, "log_format", TEXT)
    setup_logging(logging.INFO if args.verbose else logging.WARNING, log_format)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - every error ends here: one sentence and an exit code
        code = exit_code_of(exc)
        if code is not None:
            report_error(f"katamgr: {exc}", log_format, log)
            return code
        report_error(f"katamgr: unexpected {type(exc).__name__}: {exc} (run with -v for the traceback; "
                     f"please report it)", log_format, log, exc_info=getattr(args, "verbose", False))
        return 1


if __name__ == "__main__":
    sys.exit(main())
