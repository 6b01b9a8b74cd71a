"""The package layering holds (pyproject.toml's [tool.importlinter] contracts: the layers, torch-free wire
contracts, a benchmark client that imports no tier), and no two pdserve subpackages import each other at
module level (the loop the re-homing removed: engine, gpu, kv_transfer, model and parallel imported each other)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_import_graph import circles, import_graph

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).parent / "lint-imports"
    if not lint.exists():
        pytest.fail("lint-imports is missing: install the test extra (pip install -e '.[test]')")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "BROKEN" not in out.stdout and "KEPT" in out.stdout, out.stdout[-4000:]


def package_graph() -> dict[str, set[str]]:
    """The module-level import graph (tests/test_import_graph.py) folded to pdserve's first-level names."""
    folded: dict[str, set[str]] = {}
    for src, deps in import_graph().items():
        a = src.split(".")[1] if "." in src else None
        for dst in deps:
            b = dst.split(".")[1] if "." in dst else None
            if a and b and a != b:
                folded.setdefault(a, set()).add(b)
                folded.setdefault(b, set())
    return folded


def test_no_package_import_loop() -> None:
    assert circles(package_graph()) == []
