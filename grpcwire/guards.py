"""What a server keeps against clients that ask too much, by the clock: the budget of
frames that do no work (per client process) and a log that a flood cannot flood.

The I/O half's: the protocol half (``protocol``) counts the frames; the server spends them.
"""

from __future__ import annotations

import logging
import time


class Budget:
    """A token bucket of frames that do no work, for one client process (its connections
    share it, so that reconnecting does not refill it). Overdrawn, it goes down to
    minus its burst and refills from there."""

    __slots__ = ("tokens", "burst", "rate", "at")

    def __init__(self, burst: int, rate: float) -> None:
        self.tokens = float(burst)
        self.burst = burst
        self.rate = rate
        self.at = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now

    def spend(self, count: int) -> bool:
        """False once the client has overdrawn."""
        self._refill()
        self.tokens = max(-self.burst, self.tokens - count)
        return self.tokens >= 0

    def earn(self, count: int) -> None:
        self.tokens = min(self.burst, self.tokens + count)

    @property
    def overdrawn(self) -> bool:
        self._refill()
        return self.tokens < 0

    @property
    def full(self) -> bool:
        self._refill()
        return self.tokens >= self.burst


class QuietLog:
    """One log line per ``interval`` for a kind of event, saying how many were held back,
    so that a flood of bad clients cannot flood the log."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self.logger = logger
        self.interval = interval
        self._next: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, kind: str, text: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next.get(kind, 0.0):
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        held = self._held.pop(kind, 0)
        self._next[kind] = now + self.interval
        if held:
            text += " (and %d more like it in the last %.0f s)"
            args = (*args, held, self.interval)
        self.logger.warning(text, *args)
