"""The metric names a PromQL expression reads, and the names our programs export.

promtool is not installable here, and Prometheus's parser is Go; this reads PromQL far
enough to find every metric a selector names: an identifier outside strings, label
matchers (``{...}``), grouping lists (``by (...)``, ``on (...)``...), ranges and
durations, that is not followed by ``(`` (a function or aggregation) and is not one of
PromQL's keywords (prometheus/promql/parser's lexer: ``and or unless bool offset by
without on ignoring group_left group_right``, and the number literals ``inf``, ``nan``).
"""

from __future__ import annotations

import re

KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
                      "group_left", "group_right", "atan2", "inf", "nan", "start", "end"})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.I)
_RANGE = re.compile(r"\[[^\[\]]*\]")
_VARIABLE = re.compile(r"\$\{?\w+\}?")  # Grafana's ($__rate_interval, ${node})
_DURATION_OR_NUMBER = re.compile(r"\b\d[\w.]*")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """Every metric name ``expr`` selects (``{__name__="x"}`` selectors are not read)."""
    text = _STRING.sub('""', expr)
    text = _VARIABLE.sub("1", text)
    text = _MATCHERS.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _DURATION_OR_NUMBER.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        following = text[m.end():].lstrip()
        if following.startswith("(") or m.group().lower() in KEYWORDS:
            continue
        names.add(m.group())
    return names


def exposed_names(collectors) -> set[str]:
    """The series names ``prometheus_client`` exposes for these registries' families
    (``Counter`` x as x_total and x_created, a histogram's _bucket/_sum/_count/_created)."""
    names = set()
    for registry in collectors:
        for family in registry.collect():
            base = family.name
            if family.type == "counter":
                names |= {base + "_total", base + "_created"}
            elif family.type == "histogram":
                names |= {base + s for s in ("_bucket", "_sum", "_count", "_created")}
            elif family.type == "summary":
                names |= {base + s for s in ("", "_sum", "_count", "_created")}
            else:
                names.add(base)
    return names
