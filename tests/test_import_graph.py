"""The package's import graph: no module imports itself back through others, at module or function level (the
house rule "no import cycles"; the vLLM plugin's own check, with its import-alone test, is in test_vllm_patches)."""

from __future__ import annotations

from import_support import MODULES, PACKAGE, find_cycle, imports_of


def test_cycle_finder_finds_a_hand_made_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_importfind_cycle():
    graph = {m: imports_of(p) - {m} for m, p in MODULES.items()}
    assert "specdec.eval.common" in graph["specdec.eval.run_replay"]  # the graph sees real imports
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others (module and function level)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for n in graph[todo.pop()] - seen:
            seen.add(n)
            todo.append(n)
    return seen


def plugin_part(part: str) -> list[str]:
    prefix = f"specdec.vllm_plugin.{part}"
    return [m for m in MODULES if m == prefix or m.startswith(f"{prefix}.")]


def test_the_plugins_entry_never_imports_its_core():
    """``entry/`` (the user's options, the config rewrite, validation) sits apart from ``core/`` (the drafting core):
    nothing in ``entry/`` imports ``core/``, at module or function level. (``entry.register`` applies the patch
    table, whose hooks reach the modes and so the core: through other modules it may.)"""
    assert plugin_part("entry")
    for m in plugin_part("entry"):
        up = sorted(n for n in imports_of(MODULES[m]) if n.startswith("specdec.vllm_plugin.core"))
        assert not up, f"{m} imports {up}"


def test_the_plugins_core_never_imports_its_entry():
    """Nor the other way, even through other modules: the core reads the user options through its ``CoreOptions``
    (``core/user_options.py``) and the internal settings from ``internal.py``; ``settings.py`` joins them."""
    graph = {m: imports_of(p) - {m} for m, p in MODULES.items()}
    assert "specdec.vllm_plugin.entry.options" in reached(graph, "specdec.vllm_plugin.settings")  # the walk works
    assert plugin_part("core")
    for m in plugin_part("core"):
        up = sorted(n for n in reached(graph, m) if n.startswith("specdec.vllm_plugin.entry"))
        assert not up, f"{m} imports {up}"


def test_what_the_plugin_stores_on_vllm_objects_is_named_in_one_module():
    """Every attribute name the plugin sets on vLLM's objects (``_specdec_*``, ``specdec_*``) is spelled in
    ``vllm_plugin/attrs.py`` only; the modules import it from there."""
    import re

    plugin = PACKAGE / "vllm_plugin"
    spelled = re.compile(r"""["']_?specdec_[a-z_]+["']""")
    outside = [
        f"{p.relative_to(plugin)}: {m.group(0)}"
        for p in sorted(plugin.rglob("*.py"))
        if p.name != "attrs.py"
        for m in spelled.finditer(p.read_text())
    ]
    assert not outside, outside
    assert "ENGINE_BOOK" in (plugin / "attrs.py").read_text()
