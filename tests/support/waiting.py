"""Waiting in tests for something that happens in another thread or process: one rule."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(check: Callable[[], Any], what: str = "the condition", timeout: float = 30,
             every: float = 0.2):
    """check()'s first truthy value; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
        except Exception as e:  # noqa: BLE001 - the last error is the message
            last = e
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s (last: {last!r})")
        time.sleep(every)
