"""Progress lines: each step of an apply or revert as it starts and ends, on stderr.

Printed without -v and flushed at once, so an apply killed part-way has said every step it
began (the node's run journal, ``katamgr status``, says the same); on stderr, so a
``-o json`` document on stdout stays one document.
"""

from __future__ import annotations

import sys
from typing import TextIO

from gpunode.services.journal import Listener

_ENDS = {"start": "...", "done": ": done", "failed": ": FAILED"}


def progress_printer(command: str, stream: TextIO | None = None) -> Listener:
    """A journal listener printing ``<command>: <step>...`` and ``<command>: <step>: done``."""
    def tell(event: str, step: str) -> None:
        out = stream or sys.stderr
        print(f"{command}: {step}{_ENDS.get(event, '')}", file=out, flush=True)
    return tell
