"""docs/architecture.md is the map of the code: every module, class or function it names in
backticks exists, and the code carries none of the session history a map must not.

A dotted name counts as a reference to our code when its first part is one of our packages
or subpackages (``gpunode.policy.katadetect``, ``services.kube.NodeLabelWatch``,
``pipeline.offers``); it is found when some module's dotted path ends with it, or with a
leading part of it whose remaining parts are attributes of that module. A chart value
spelled the same way (``dra.enabled``) is recognised by values.yaml. Paths with a slash
(``katamgr/pipeline/``, ``tests/kata``) must exist in the tree.
"""

from __future__ import annotations

import importlib
import re
from functools import cache
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
MAP = REPO / "docs" / "architecture.md"
PACKAGES = ("katamgr", "sandbox_plugin", "gpunode", "nodesim", "grpcwire", "cdi", "kubeletapi")
VALUES = REPO / "deploy" / "helm" / "kata-sandbox-manager" / "values.yaml"
CODE_DIRS = PACKAGES + ("tests", "bench", "hack", "deploy", ".ci")
# a file named in the map (``vfio.json``, ``build.py``) is not a module reference
FILE_SUFFIXES = ("json", "py", "yaml", "toml", "md", "txt", "tpl", "go", "sock", "so", "h", "lock")
CODE_SUFFIXES = (".py", ".go", ".tpl", ".yaml", ".sh", ".c", ".h", ".toml")


@cache
def modules() -> frozenset[str]:
    found = set()
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found.add(".".join(parts))
    return frozenset(found)


@cache
def segments() -> frozenset[str]:
    return frozenset(part for name in modules() for part in name.split("."))


def _flatten(tree: object, prefix: str = "") -> set[str]:
    keys = set()
    if isinstance(tree, dict):
        for key, value in tree.items():
            name = f"{prefix}{key}"
            keys.add(name)
            keys |= _flatten(value, name + ".")
    return keys


@cache
def chart_values() -> frozenset[str]:
    return frozenset(_flatten(yaml.safe_load(VALUES.read_text())))


def _modules_ending(suffix: str) -> list[str]:
    return [m for m in modules() if m == suffix or m.endswith("." + suffix)]


def resolves(name: str) -> bool:
    if _modules_ending(name):
        return True
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        for module in _modules_ending(".".join(parts[:cut])):
            obj = importlib.import_module(module)
            try:
                for attribute in parts[cut:]:
                    obj = getattr(obj, attribute)
            except AttributeError:
                continue
            return True
    return False


def dotted_references(text: str) -> set[str]:
    names = set(re.findall(r"`([a-z_][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`", text))
    return {n for n in names if n.split(".")[0] in segments() and n not in chart_values()
            and n.rsplit(".", 1)[1] not in FILE_SUFFIXES}


def path_references(text: str) -> set[str]:
    names = set(re.findall(r"`((?:[A-Za-z_.][\w.-]*/)+[\w.-]*)`", text))
    return {n for n in names if n.split("/")[0] in CODE_DIRS + ("docs", "examples")}


def test_every_module_the_map_names_exists():
    text = MAP.read_text()
    missing = sorted(n for n in dotted_references(text) if not resolves(n))
    assert not missing, f"docs/architecture.md names code that does not exist: {missing}"


def test_every_path_the_map_names_exists():
    text = MAP.read_text()
    missing = sorted(n for n in path_references(text) if not (REPO / n.rstrip("/")).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_the_check_finds_a_name_that_is_gone():
    # The check itself can fail: a module from before the core moved into gpunode is caught.
    assert not resolves("host.katadetect")
    assert not resolves("node.kube.NodeLabelWatch")
    assert resolves("policy.katadetect") and resolves("services.kube.NodeLabelWatch")
    assert "host.katadetect" in dotted_references("`host.katadetect`")


def test_no_issue_numbers_in_code():
    """Comments and docstrings say why in the field's words; the project's issue numbers mean
    nothing to a reader of the code (upstream ones, ``kubernetes#125579``, do)."""
    pattern = re.compile(r"\b[Ii]ssues? \d+")
    hits = []
    for top in CODE_DIRS:
        root = REPO / top
        for path in root.rglob("*") if root.is_dir() else ():
            if path.suffix in CODE_SUFFIXES and path.is_file() and ".venv" not in path.parts:
                for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                    if pattern.search(line):
                        hits.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not hits, "issue numbers in code:\n" + "\n".join(hits)
