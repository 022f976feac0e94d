"""The packages import each other without loops: every module of vegas_core, vegas_kernels
and vegas_tune is parsed (not imported), the module-level imports of the project's own
modules make a graph, and a cycle in it fails naming its modules. Imports under ``if
TYPE_CHECKING:`` never run and are left out. Function-level imports of the project's own
modules, the usual way a loop is hidden, are refused too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("vegas_core", "vegas_kernels", "vegas_tune")


def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``packages`` under ``root``."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, at_module_level: bool):
    """The import statements that run when the module is imported (``at_module_level``:
    outside functions, TYPE_CHECKING blocks left out), or those inside functions."""
    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                       ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)) and inside != at_module_level:
                yield child
            yield from walk(child, inside)
    yield from walk(tree, False)


def _targets(node, name: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The project modules an import statement of module ``name`` loads by name."""
    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            found.add(known(alias.name))
        return found - {None}
    base = node.module or ""
    if node.level:
        package = name.split(".") if is_package else name.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        found.add(submodule if submodule in modules else known(base))
    return found - {None}


def import_graph(modules: dict[str, Path], at_module_level: bool = True
                 ) -> dict[str, set[str]]:
    """module -> the project modules it imports (at module level, or inside functions)."""
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges = set()
        for node in _imports(tree, at_module_level):
            edges |= _targets(node, name, path.name == "__init__.py", modules)
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_module_level_import_loop():
    cycle = find_cycle(import_graph(module_files(ROOT)))
    assert cycle is None, "import loop: " + " -> ".join(cycle)


def test_the_project_is_imported_at_module_level():
    """A function-level import of the project's own module hides a loop from the test
    above; heavy third-party packages (optuna, pandas, matplotlib) may be deferred."""
    inside = {name: edges for name, edges in
              import_graph(module_files(ROOT), at_module_level=False).items() if edges}
    assert not inside, f"function-level imports of project modules: {inside}"


def test_the_check_finds_a_loop_through_a_package_and_a_relative_import(tmp_path):
    """The graph sees ``from pkg import name`` (an edge to the package), relative imports
    and class bodies, and leaves out TYPE_CHECKING blocks and function bodies."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.a import A\n")
    (pkg / "a.py").write_text("class A:\n    from .b import B\n")
    (pkg / "b.py").write_text("from pkg import A\nB = 1\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from pkg.d import D\n")
    (pkg / "d.py").write_text("from pkg.c import C\n\ndef f():\n    from pkg.a import A\n")
    modules = module_files(tmp_path, ("pkg",))
    graph = import_graph(modules)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg"}, "pkg.c": set(),
                     "pkg.d": {"pkg.c"}}
    assert find_cycle(graph) == ["pkg", "pkg.a", "pkg.b", "pkg"]
    assert import_graph(modules, at_module_level=False)["pkg.d"] == {"pkg.a"}
