"""What ``katamgr webhook`` lets its clients hold: connections, time, bytes and threads.

Anything that can reach the webhook's Service (any pod, with the chart's defaults) can
connect to it, and with ``failurePolicy: Fail`` a webhook that falls over stops every pod
create it reviews. So every resource a client can make it hold has a bound here, and the
bounds hold whatever the clients do (a thread per connection and a per-read timeout once
let 3,000 half-sent TLS connections take it past its memory limit).

No ``ssl`` here: ``katamgr --help`` reads the flags' defaults from this module.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

KIB = 1024
MIB = 1024 * KIB


@dataclass(frozen=True)
class Limits:
    # Connections open at once. The next one makes room by closing the oldest connection
    # not being answered of the client address holding the most (its slowest request, or
    # its longest idle keep-alive); when every connection is being answered it is closed.
    max_connections: int = 256
    # Threads that parse reviews and run the rules (pure CPU under the GIL: more would not
    # answer faster; two keep one large review from holding up the small ones).
    workers: int = 2
    # TLS handshake, request line, headers and body must all arrive within this of the
    # connection's accept (or of a keep-alive request's first byte), and the answer must
    # be taken by the client within it too: the API server's default webhook timeout, after
    # which nobody waits for the answer anyway.
    request_timeout: float = 10.0
    # A keep-alive connection with no request for this long is closed. Longer than the
    # API server's own idle timeout (Go's 90 s), so that the client, not the server, ends
    # an idle connection and a request never races the close.
    idle_timeout: float = 120.0
    # Request line and headers (Go's client sends about 200 bytes).
    max_head: int = 64 * KIB
    max_headers: int = 100
    # Bytes held for all connections together: requests being read or waiting for a
    # worker, answers the client has not taken. Past it the connection holding the most
    # that is not being answered is closed (a 3 MiB review at most ten times over).
    max_buffered: int = 32 * MIB

    def __post_init__(self) -> None:
        for name in ("max_connections", "workers", "max_head", "max_headers", "max_buffered"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        for name in ("request_timeout", "idle_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be more than 0 s, not {getattr(self, name)}")


DEFAULT = Limits()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is less than 1")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < 86400:
        raise argparse.ArgumentTypeError(f"{text} s is not between 0 and a day")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``katamgr webhook`` that set its Limits."""
    parser.add_argument("--max-connections", type=_positive_int, default=DEFAULT.max_connections,
                        metavar="N", help="connections open at once; the next one closes the oldest "
                        "unfinished or idle connection of the busiest client address (default "
                        f"{DEFAULT.max_connections})")
    parser.add_argument("--workers", type=_positive_int, default=DEFAULT.workers, metavar="N",
                        help=f"threads that review requests (default {DEFAULT.workers})")
    parser.add_argument("--request-timeout", type=_seconds, default=DEFAULT.request_timeout,
                        metavar="SECONDS", help="a request's TLS handshake, headers and body must "
                        "all arrive within this, and its answer be read within it (default "
                        f"{DEFAULT.request_timeout:g}, the API server's webhook timeout)")
    parser.add_argument("--idle-timeout", type=_seconds, default=DEFAULT.idle_timeout,
                        metavar="SECONDS", help="close a keep-alive connection idle for this long "
                        f"(default {DEFAULT.idle_timeout:g})")


def from_args(args: argparse.Namespace) -> Limits:
    return Limits(max_connections=args.max_connections, workers=args.workers,
                  request_timeout=args.request_timeout, idle_timeout=args.idle_timeout)
