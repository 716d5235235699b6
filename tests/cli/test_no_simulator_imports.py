"""The simulated node is off the product's path: no module of katamgr or sandbox_plugin
imports nodesim, at module level, inside a function or under TYPE_CHECKING (import-linter's
contract in pyproject.toml sees the first kind; this walk sees them all), and the programs
find it only through the entry point pyproject.toml declares, saying so in one sentence
where it is not installed."""

from __future__ import annotations

import ast
import importlib.metadata
import tomllib
from importlib.metadata import EntryPoint

import pytest
from support.paths import REPO

from gpunode.services import simulator
from katamgr.cli import main

PRODUCT = ("katamgr", "sandbox_plugin", "gpunode")


def _is_nodesim(name: str | None) -> bool:
    return name is not None and (name == "nodesim" or name.startswith("nodesim."))


def simulator_imports(source: str) -> list[int]:
    """The lines of ``source`` that import nodesim, wherever they are (importlib's
    import_module and __import__ with a literal name included)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(_is_nodesim(a.name) for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_nodesim(node.module):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and _is_nodesim(str(node.args[0].value)):
                lines.append(node.lineno)
    return lines


def test_the_walk_finds_every_kind_of_import():
    source = ("import nodesim\nif TYPE_CHECKING:\n    from nodesim.node import open_node\n"
              "def f():\n    import nodesim.kernel as k\n    importlib.import_module('nodesim.udev')\n"
              "import nodesimulator\nfrom katamgr import nodesim_free\n")
    assert simulator_imports(source) == [1, 3, 5, 6]


def test_no_product_module_imports_the_simulated_node():
    found = {
        f"{path.relative_to(REPO)}:{line}"
        for package in PRODUCT
        for path in sorted((REPO / package).rglob("*.py"))
        for line in simulator_imports(path.read_text())
    }
    assert found == set()


def test_the_entry_point_is_the_simulator_the_programs_use():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    value = declared[simulator.GROUP][simulator.NAME]
    sim = EntryPoint(simulator.NAME, value, simulator.GROUP).load()
    assert "dgx-h100" in sim.profile_names()
    assert sim.profile("dgx-h100").devices > 8


@pytest.fixture
def no_simulator(monkeypatch):
    """A production install: no entry point in the group and no KATAMGR_SIMULATOR."""
    monkeypatch.delenv(simulator.ENV, raising=False)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **_: [])
    simulator.installed.cache_clear()
    yield
    simulator.installed.cache_clear()


@pytest.mark.parametrize("argv", [["demo"], ["plan", "--host", "dgx-h100"], ["simulate", "a10-server", "--into", "x"]])
def test_without_the_simulator_a_simulated_command_says_so_and_exits_2(no_simulator, argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("katamgr: ") and "needs the simulated node (nodesim), which is not installed" in err
    assert err.count("\n") == 0


def test_without_the_simulator_help_and_a_real_root_still_work(no_simulator, tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    assert "shipped host profiles: none (the simulated node is not installed)" in capsys.readouterr().out
    assert main(["status", "--host-root", str(tmp_path)]) == 0
    assert "Nothing installed" in capsys.readouterr().out


def test_a_simulator_that_cannot_load_is_named(monkeypatch, capsys):
    monkeypatch.setenv(simulator.ENV, "nodesim.nosuchmodule:SIMULATOR")
    simulator.installed.cache_clear()
    try:
        assert main(["demo"]) == 2
    finally:
        simulator.installed.cache_clear()
    err = capsys.readouterr().err
    assert "the simulated node 'nodesim.nosuchmodule:SIMULATOR' cannot be loaded" in err
    assert "fix or unset KATAMGR_SIMULATOR" in err
