"""The package's import graph: no module imports itself back through others, at module or function level (the
house rule "no import cycles"; the vLLM plugin's own check, with its import-alone test, is in test_vllm_patches)."""

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


def _imports(path: Path) -> set[str]:
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


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
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


def test_cycle_finder_finds_a_hand_made_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_import_cycle():
    graph = {m: _imports(p) - {m} for m, p in MODULES.items()}
    assert "specdec.eval.common" in graph["specdec.eval.run_replay"]  # the graph sees real imports
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_plugins_entry_never_imports_its_core():
    """``entry/`` (options, the config rewrite, validation) sits below ``core/`` (the drafting core, which reads the
    options): nothing in ``entry/`` imports ``core/``, at module or function level, so the two never import each
    other."""
    entry = {m: p for m, p in MODULES.items() if m.startswith("specdec.vllm_plugin.entry")}
    assert entry
    for m, p in entry.items():
        up = sorted(n for n in _imports(p) if n.startswith("specdec.vllm_plugin.core"))
        assert not up, f"{m} imports {up}"
