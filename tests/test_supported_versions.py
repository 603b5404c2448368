"""The tested vLLM versions and the supported span (src/specdec/vllm_plugin/versions.py), and the places that repeat
them: the ``vllm`` extra in pyproject.toml and the list scripts/test.sh reads from the file's text."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.vllm_plugin import versions
from specdec.vllm_plugin.versions import in_tested_span

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.26.0", True),  # the lower bound is inclusive
        ("0.26", True),
        ("0.26.3", True),
        ("0.26.0+cu129", True),  # a local build counts as its release
        ("0.26.0.post1", True),
        ("0.33.0", True),
        ("0.33.9", True),
        ("v0.30.1", True),
        ("0.26.0rc1", False),  # a pre-release sorts before its release
        ("0.27.0.dev12+g1a2b3c", True),  # ... which is inside the span here
        ("0.25.9", False),
        ("0.34.0", False),  # the upper bound is exclusive
        ("0.34.0rc2", False),  # ... for its pre-releases too
        ("1.0.0", False),
        ("0.9.0", False),
        ("unknown", False),  # a version the plugin cannot place is treated as untested
        ("", False),
    ],
)
def test_in_tested_span(version: str, expected: bool) -> None:
    assert in_tested_span(version) is expected


def test_tested_versions_lie_in_the_span_and_the_extra_spells_it() -> None:
    assert versions.TESTED_VLLM_VERSIONS, "at least one tested vLLM version"
    assert all(in_tested_span(v) for v in versions.TESTED_VLLM_VERSIONS)
    text = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r'^vllm = \["([^"]+)"\]', text, re.MULTILINE)
    assert extra is not None, "pyproject.toml has a `vllm = [...]` extra"
    assert extra[1] == versions.VLLM_REQUIREMENT == "vllm>=0.26,<0.34"


def test_test_script_reads_the_same_versions_from_the_file_text() -> None:
    """scripts/test.sh parses versions.py without importing specdec; its parser yields the module's tuple."""
    script = (ROOT / "scripts" / "test.sh").read_text()
    parser = re.search(r"<<'PARSE_VERSIONS'\n(.*?)\nPARSE_VERSIONS\n", script, re.DOTALL)
    assert parser is not None, "scripts/test.sh keeps its version parser in a PARSE_VERSIONS here-document"
    path = ROOT / "src" / "specdec" / "vllm_plugin" / "versions.py"
    out = subprocess.run([sys.executable, "-", str(path)], input=parser[1], capture_output=True, text=True, check=True)
    assert tuple(out.stdout.split()) == versions.TESTED_VLLM_VERSIONS
    ast.parse(path.read_text())  # the file stays plain Python the parser can read
