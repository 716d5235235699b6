"""Layout-keeping edits of TOML documents (tomlkit).

Operators read these files: a key we add must sit with its siblings at their
indentation, and a value we leave alone must keep its quoting. So values are only
assigned when they really differ, and new tables and keys are indented the way the
surrounding file is.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import tomlkit
from tomlkit.container import Container
from tomlkit.items import InlineTable, Item, Table, Whitespace

Path_ = tuple[str, ...]


def plain(value: Any) -> Any:
    """A tomlkit value as plain Python (dicts, lists, scalars)."""
    return value.unwrap() if hasattr(value, "unwrap") else value


def lookup(doc: Any, path: Sequence[str], default: Any = None) -> Any:
    node: Any = doc
    for key in path:
        if not isinstance(node, MutableMapping) or key not in node:
            return default
        node = node[key]
    return node


def _spaces(indent: str) -> str:
    return indent.rsplit("\n", 1)[-1]


def _header_indent(table: Table) -> str | None:
    """Indentation of a table's own ``[header]``, None for a header-less table."""
    if table.is_super_table():
        return None
    return _spaces(table.trivia.indent)


def _first_child_indent(table: Table) -> str | None:
    for _key, item in table.value.body:
        if isinstance(item, Whitespace) or item is None:
            continue
        if isinstance(item, Table) and item.is_super_table():
            continue
        return _spaces(item.trivia.indent)
    return None


class _Style:
    """Indentation the file uses: a base at some depth and a step per level."""

    def __init__(self, base_depth: int, base: int, step: int) -> None:
        self.base_depth, self.base, self.step = base_depth, base, step

    def header(self, depth: int) -> str:
        return " " * max(0, self.base + self.step * (depth - self.base_depth))

    def key(self, table_depth: int) -> str:
        return self.header(table_depth + 1)


def style_for(doc: Container, path: Sequence[str]) -> _Style:
    """Guess the indentation used around ``path`` from its nearest header-bearing ancestor."""
    nodes: list[Any] = [doc]
    for key in path:
        node = nodes[-1]
        if not isinstance(node, MutableMapping) or key not in node:
            break
        nodes.append(node[key])
    for depth in range(len(nodes) - 1, 0, -1):
        table = nodes[depth]
        if not isinstance(table, Table):
            continue
        header = _header_indent(table)
        if header is None:
            continue
        child = _first_child_indent(table)
        step = len(child) - len(header) if child is not None else (2 if header else 0)
        # depth counts path elements, so the table at nodes[d] has depth d - 1
        return _Style(depth - 1, len(header), max(step, 0))
    return _Style(0, 0, 0)


def ensure_table(doc: Container, path: Sequence[str]) -> tuple[Any, list[Path_]]:
    """The table at ``path``, creating header-less parents; returns it and what was created."""
    created: list[Path_] = []
    node: Any = doc
    for i, key in enumerate(path):
        if key not in node:
            # None: tomlkit prints no header while the table only holds tables
            new = tomlkit.table(is_super_table=None)
            insert(node, key, new)
            created.append(tuple(path[: i + 1]))
        node = node[key]
        if not isinstance(node, MutableMapping) or isinstance(node, InlineTable):
            raise TypeError(f"{'.'.join(path[: i + 1])} is not a table")
    return node, created


def insert(node: Any, key: str, item: Item) -> None:
    """Add ``item`` under ``key`` keeping the indentation we gave it."""
    wanted = item.trivia.indent
    if isinstance(node, Table):
        node.raw_append(key, item)
    elif isinstance(node, Container):
        node.append(key, item)
    else:
        # A table split across the file (out-of-order parts): tomlkit picks the part
        # and prefixes that part's indentation; put ours back afterwards.
        node[key] = item
        item.trivia.indent = wanted


def set_value(doc: Container, path: Sequence[str], value: Any) -> bool:
    """Set a scalar/array at ``path`` unless it already holds an equal value."""
    table, _ = ensure_table(doc, path[:-1])
    key = path[-1]
    if key in table:
        if plain(table[key]) == value:
            return False
        table[key] = value  # tomlkit keeps the old item's position and indentation
        return True
    headerless = isinstance(table, Table) and table.is_super_table()
    style = style_for(doc, path[:-1])
    new = tomlkit.item(value)
    sibling = _first_key_indent(table) if isinstance(table, Table) else None
    new.trivia.indent = sibling if sibling is not None else style.key(len(path) - 2)
    insert(table, key, new)
    if headerless:
        # Holding a key now, the table prints its own header: indent it like its peers.
        table.trivia.indent = style.header(len(path) - 2)
    return True


def _first_key_indent(table: Table) -> str | None:
    for _key, item in table.value.body:
        if isinstance(item, Item) and not isinstance(item, (Table, Whitespace)):
            return _spaces(item.trivia.indent)
    return None


def add_table(doc: Container, path: Sequence[str], content: dict[str, Any]) -> list[Path_]:
    """Add a new table (with nested tables) at ``path``, indented like the file around it.

    Returns the header-less parent tables that had to be created.
    """
    style = style_for(doc, path[:-1])
    parent, created = ensure_table(doc, path[:-1])
    before = parent.as_string() if isinstance(parent, (Table, Container)) else ""
    # One blank line between our table and whatever precedes it, never two.
    lead = "" if (not doc.as_string().strip() or before.endswith("\n\n")) else "\n"
    table = _build(content, style, len(path) - 1, lead)
    insert(parent, path[-1], table)
    return created


def _build(content: dict[str, Any], style: _Style, depth: int, lead: str) -> Table:
    table = tomlkit.table()
    table.trivia.indent = lead + style.header(depth)
    scalars = {k: v for k, v in content.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in content.items() if isinstance(v, dict)}
    for key, value in scalars.items():
        item = tomlkit.item(value)
        item.trivia.indent = style.key(depth)
        table.raw_append(key, item)
    if tables or not scalars:
        table.raw_append(None, tomlkit.nl())
    for key, value in tables.items():
        table.raw_append(key, _build(value, style, depth + 1, ""))
    if not tables:
        table.raw_append(None, tomlkit.nl())
    return table


def delete(doc: Container, path: Sequence[str]) -> bool:
    parent = lookup(doc, path[:-1])
    if not isinstance(parent, MutableMapping) or path[-1] not in parent:
        return False
    del parent[path[-1]]
    return True


def prune_empty(doc: Container, paths: Sequence[Sequence[str]]) -> None:
    """Remove tables among ``paths`` that are now empty (deepest first)."""
    for path in sorted(paths, key=len, reverse=True):
        node = lookup(doc, path)
        if isinstance(node, MutableMapping) and not plain(node):
            delete(doc, path)


def to_item(value: Any) -> Any:
    """A plain value back into something tomlkit can store (tables for dicts)."""
    if isinstance(value, dict):
        table = tomlkit.table()
        for key, inner in value.items():
            table[key] = to_item(inner)
        return table
    return value
