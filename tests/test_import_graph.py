"""No file-level import circle inside pdserve/ (issue 33).

A circle of modules that import each other at module level makes the import order decide whether a name exists
yet, and ties files that should be read apart. The graph here is what Python runs on import: module-level
`import` / `from ... import` statements (an `if TYPE_CHECKING:` block and function-local imports excluded, as
they run later or never), `from pdserve.x import y` resolved to the submodule pdserve.x.y where y is one, and
importing pdserve.a.b.c also running the `__init__` of pdserve.a and pdserve.a.b (except the importer's own
packages, which are already being imported). Run this file as a script to print the circles.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module under pdserve/: dotted name -> file (a package by its `__init__.py`)."""
    mods = {}
    for f in (root / "pdserve").rglob("*.py"):
        parts = f.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _module_level_imports(tree: ast.Module):
    """Import statements that run when the module is imported: its body, and the bodies of module-level
    if/try/with blocks, never function or class bodies; `if TYPE_CHECKING:` blocks skipped (their else runs)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            todo.extend(node.orelse if _is_type_checking(node) else node.body + node.orelse)
        elif isinstance(node, ast.Try):
            todo.extend(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
        elif isinstance(node, ast.With):
            todo.extend(node.body)


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the pdserve modules its import runs (see the module docstring)."""
    mods = module_files(root)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        targets: set[str] = set()
        for node in _module_level_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            else:
                mod = _absolute(node, name, is_package)
                targets.add(mod)
                targets.update(f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in mods)
        deps: set[str] = set()
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):  # the packages on the way run their __init__ first
                dep = ".".join(parts[:i])
                if dep in mods and dep not in own_packages:
                    deps.add(dep)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_checker_sees_a_circle(tmp_path: Path) -> None:
    """The graph follows submodule imports, relative imports and package __init__s, and skips TYPE_CHECKING
    blocks and function bodies."""
    pkg = tmp_path / "pdserve" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "pdserve" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from pdserve.sub import a\n")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("from pdserve import c\n")
    (tmp_path / "pdserve" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pdserve.d\n"
        "def f():\n    import pdserve.d\n")
    (tmp_path / "pdserve" / "d.py").write_text("import pdserve.sub.b\n")
    graph = import_graph(tmp_path)
    assert graph["pdserve.sub.a"] == {"pdserve.sub.b"}
    assert graph["pdserve.sub.b"] == {"pdserve.c"}
    assert graph["pdserve.c"] == set()
    assert graph["pdserve.d"] == {"pdserve.sub", "pdserve.sub.b"}
    assert circles(graph) == []
    (tmp_path / "pdserve" / "c.py").write_text("import pdserve.d\n")  # d -> sub/__init__ -> a -> b -> c -> d
    assert circles(import_graph(tmp_path)) == [["pdserve.c", "pdserve.d", "pdserve.sub", "pdserve.sub.a",
                                                 "pdserve.sub.b"]]


def test_no_file_level_import_circle() -> None:
    found = circles(import_graph())
    assert not found, "module-level import circles in pdserve/:\n" + "\n".join(" <-> ".join(c) for c in found)


if __name__ == "__main__":
    for c in circles(import_graph()):
        print("circle:", " <-> ".join(c))
    sys.exit(0)
