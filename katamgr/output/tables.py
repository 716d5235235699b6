"""Tables sized to the terminal, the way ``kubectl get`` prints them.

A plan's table must be readable in an 80-100 column terminal: the columns that hold
prose (a reason, a model name) are cut with an ellipsis to fit, in the order given, down
to a floor; ``-o wide`` adds columns and shows every cell in full.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass

ELLIPSIS = "…"
GAP = "  "
# The width assumed when the output is not a terminal (a pipe, a file, a test): wide
# enough for the default columns, narrow enough for a review in a pull request.
DEFAULT_WIDTH = 100


def terminal_width() -> int:
    """The terminal's width ($COLUMNS first, as the shell sets it), or DEFAULT_WIDTH."""
    return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns


@dataclass(frozen=True)
class Column:
    header: str
    # The narrowest this column is cut to when the row is too wide (None: never cut).
    floor: int | None = None


def cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, ending in an ellipsis when it was longer."""
    if len(text) <= width:
        return text
    if width <= 1:
        return ELLIPSIS[:width]
    return text[: width - 1].rstrip() + ELLIPSIS


def table(columns: Sequence[Column], rows: Sequence[Sequence[object]], *,
          width: int | None = None, headers: bool = True) -> str:
    """Rows under their headers; with ``width`` the cuttable columns (``Column.floor``)
    are cut, the widest first, until every line fits (or every one is at its floor)."""
    cells = [[("-" if c is None else str(c)) for c in row] for row in rows]
    shown = [c.header for c in columns]
    widths = [max([len(h) if headers else 0, *(len(r[i]) for r in cells)]) for i, h in enumerate(shown)]
    if width is not None:
        widths = _fit(columns, widths, width)
    def line(values: Sequence[str]) -> str:
        return GAP.join(cut(v, widths[i]).ljust(widths[i]) for i, v in enumerate(values)).rstrip()
    return "\n".join([*([line(shown)] if headers else []), *(line(r) for r in cells)])


def _fit(columns: Sequence[Column], widths: list[int], width: int) -> list[int]:
    # One character at a time from the widest column that may still be cut: two long
    # cells (a model, a reason) both stay readable rather than one cut to its floor.
    widths = list(widths)
    over = sum(widths) + len(GAP) * (len(widths) - 1) - width
    while over > 0:
        cuttable = [i for i, c in enumerate(columns) if c.floor is not None and widths[i] > c.floor]
        if not cuttable:
            break
        widest = max(cuttable, key=lambda i: widths[i])
        widths[widest] -= 1
        over -= 1
    return widths
