"""The package layering holds (pyproject.toml's [tool.importlinter] contracts: the layers, torch-free wire
contracts, a benchmark client that imports no tier), and no two pdserve subpackages import each other at
module level (the loop the re-homing removed: engine, gpu, kv_transfer, model and parallel imported each other)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pdserve"


def test_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).parent / "lint-imports"
    if not lint.exists():
        pytest.fail("lint-imports is missing: install the test extra (pip install -e '.[test]')")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "BROKEN" not in out.stdout and "KEPT" in out.stdout, out.stdout[-4000:]


def _unit(module: str) -> str | None:
    """The first name under pdserve (a subpackage or a top-level module), or None outside pdserve."""
    parts = module.split(".")
    return parts[1] if parts[0] == "pdserve" and len(parts) > 1 else None


def _module_level_imports(tree: ast.Module) -> list[str]:
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for n in [node] if not isinstance(node, (ast.If, ast.Try)) else ast.walk(node):
            if isinstance(n, ast.Import):
                names += [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                names.append(n.module)
    return names


def package_edges(root: Path = PACKAGE) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for f in root.rglob("*.py"):
        src = _unit(".".join(f.relative_to(root.parent).with_suffix("").parts))
        if src is None:
            continue
        for name in _module_level_imports(ast.parse(f.read_text(encoding="utf-8"))):
            dst = _unit(name)
            if dst is not None and dst != src:
                edges.setdefault(src, set()).add(dst)
    return edges


def loops(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one node (Tarjan, recursive: the graph has ~30 nodes)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(comp)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_loop_finder_finds_a_loop() -> None:
    assert loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert loops({"a": {"b"}, "b": set()}) == []


def test_no_package_import_loop() -> None:
    assert loops(package_edges()) == []
