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


def test_the_plugins_entry_never_imports_its_core():
    """``entry/`` (options, the config rewrite, validation) sits below ``core/`` (the drafting core, which reads the
    options): nothing in ``entry/`` imports ``core/``, at module or function level, so the two never import each
    other."""
    entry = {m: p for m, p in MODULES.items() if m.startswith("specdec.vllm_plugin.entry")}
    assert entry
    for m, p in entry.items():
        up = sorted(n for n in imports_of(p) if n.startswith("specdec.vllm_plugin.core"))
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
