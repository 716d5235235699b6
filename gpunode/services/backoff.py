"""Capped exponential backoff, the one rule every retry of both programs follows.

The agent retries a failed reconcile (2 s doubling to 5 min), the device plugin a refused
or lost registration (0.5 s doubling to 30 s), the DRA driver a slice write the API server
did not take (1 s doubling to 30 s): each waits longer after each failure in a row, never
longer than its cap, and starts over after a success.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    initial: float = 0.5
    factor: float = 2.0
    cap: float = 30.0

    def delays(self) -> Iterator[float]:
        """The delay before each try after the first, for as many as are asked."""
        delay = self.initial
        while True:
            yield delay
            delay = min(delay * self.factor, self.cap)


class Retries:
    """Failures in a row and the delay they have earned: ``failed()`` gives the delay
    before the next try, ``succeeded()`` starts over."""

    def __init__(self, backoff: Backoff) -> None:
        self.backoff = backoff
        self.delay: float | None = None  # the delay now pending (None: the last try succeeded)
        self._delays: Iterator[float] | None = None

    def failed(self) -> float:
        if self._delays is None:
            self._delays = self.backoff.delays()
        self.delay = next(self._delays)
        return self.delay

    def succeeded(self) -> None:
        self.delay = self._delays = None
