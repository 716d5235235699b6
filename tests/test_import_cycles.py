"""No import circle between our modules, counting every import a reader sees.

import-linter's graph leaves out `if TYPE_CHECKING:` imports (pyproject says so) and a
circle closed by an import inside a function still binds the two modules together: each
needs the other to be understood, tested or moved. So this test reads every module's AST
itself, takes all of its imports wherever they stand, and fails naming each circle.

A package's `__init__` that re-exports a name (`from .running import Agent`) is followed
to the module that defines the name, so `from katamgr.agent import Agent` is an arrow to
`katamgr.agent.running`, not to the package; importing `a.b.c` is not counted as
importing `a.b`'s `__init__` (Python runs it, but only what it defines is used).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("katamgr", "sandbox_plugin", "gpunode", "grpcwire", "cdi", "kubeletapi", "nodesim")

@dataclass
class Module:
    name: str
    is_package: bool
    tree: ast.Module
    # name bound at the top level -> the module it was imported from (for re-exports)
    reexports: dict[str, str] = field(default_factory=dict)
    # names the module itself defines at the top level
    defined: set[str] = field(default_factory=set)


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def load_modules() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            name, is_package = _module_name(path)
            tree = ast.parse(path.read_text(), filename=str(path))
            modules[name] = Module(name, is_package, tree)
    for module in modules.values():
        for node in module.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                module.defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for leaf in ast.walk(target):
                        if isinstance(leaf, ast.Name):
                            module.defined.add(leaf.id)
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, node)
                for alias in node.names:
                    module.reexports[alias.asname or alias.name] = f"{source}.{alias.name}"
    return modules


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.name.split(".")
    # a package's own name is its __init__'s package; a module's package is its parent
    base = base if module.is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _resolve(target: str, modules: dict[str, Module], seen: frozenset[str] = frozenset()) -> str | None:
    """The module that `target` (a module, or a module's attribute) comes from, or None
    where it is none of ours."""
    if target in modules:
        return target
    owner, _, attr = target.rpartition(".")
    if owner not in modules or target in seen:
        return None
    module = modules[owner]
    if module.is_package and attr not in module.defined and attr in module.reexports:
        followed = _resolve(module.reexports[attr], modules, seen | {target})
        if followed is not None:
            return followed
    return owner


def edges(modules: dict[str, Module]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for module in modules.values():
        for node in ast.walk(module.tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, node)
                targets = [f"{source}.{alias.name}" for alias in node.names if alias.name != "*"]
                targets.append(source)
            for target in targets:
                resolved = _resolve(target, modules)
                # `from pkg import x` names pkg too; the arrow to pkg's own __init__ only
                # counts where x is defined there (handled by _resolve of pkg.x).
                if resolved is None or resolved == module.name:
                    continue
                if isinstance(node, ast.ImportFrom) and target == _absolute(module, node) and modules[resolved].is_package:
                    continue
                graph[module.name].add(resolved)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm),
    each sorted, the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:
        nonlocal counter
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(found)


def _describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    arrows = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return "; ".join(arrows)


def test_no_module_imports_itself_through_others():
    graph = edges(load_modules())
    found = circles(graph)
    assert not found, "import circles (every import counted):\n" + "\n".join(
        _describe(c, graph) for c in found
    )


def test_the_finder_sees_a_circle_closed_inside_a_function_and_under_type_checking():
    # The finder itself: a circle closed only by a function-level import and a
    # TYPE_CHECKING one, as the modules this test guards once were.
    source_a = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n"
    source_b = "def f():\n    from pkg import a\n    return a\n"
    modules = {
        "pkg": Module("pkg", True, ast.parse("from .a import A\n")),
        "pkg.a": Module("pkg.a", False, ast.parse(source_a + "class A: ...\n")),
        "pkg.b": Module("pkg.b", False, ast.parse(source_b + "class B: ...\n")),
    }
    modules["pkg"].reexports["A"] = "pkg.a.A"
    assert circles(edges(modules)) == [["pkg.a", "pkg.b"]]
