"""The package's import graph as the AST reads it (imports at module and function level), for the layout tests
(``test_import_graph.py``, ``test_vllm_patches.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

import specdec

PACKAGE = Path(specdec.__file__).parent


def _modules() -> dict[str, Path]:
    root = PACKAGE.parent
    out = {}
    for p in PACKAGE.rglob("*.py"):
        name = ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        out[name] = p
    return out


MODULES = _modules()


def imports_of(path: Path) -> set[str]:
    """The package modules a file imports anywhere in its code (``from a.b import c``: ``a.b.c`` if that is a
    module, else ``a.b``); a package's ``__init__`` counts as importing nothing of its own children."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specdec"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in MODULES else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("specdec")}
    return out & set(MODULES)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None
