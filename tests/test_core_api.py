"""The public namespace: one `import specdec` reaches drafters, verifiers, eval and the generation API."""

from __future__ import annotations

import importlib
import subprocess
import sys

import specdec


def test_generate_stays_a_function_after_its_module_is_imported():
    importlib.import_module("specdec.generation")
    assert callable(specdec.generate) and specdec.generate.__module__ == "specdec.generation"
    assert specdec.SpecGenerator.__name__ == "SpecGenerator"


def test_subpackages_live_under_the_specdec_namespace(tmp_path):
    for name in ("specdec.drafters", "specdec.verifiers", "specdec.eval", "specdec.configs"):
        assert importlib.import_module(name).__name__ == name
    # Outside the source tree (which `python -m pytest` puts on sys.path) no generic top-level name leaks.
    code = "import importlib.util as u; print([n for n in ('drafters', 'verifiers', 'eval') if u.find_spec(n)])"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
