"""The wheel ships every package: the src layout's package discovery (``[tool.setuptools.packages.find]``) finds
each folder with an ``__init__.py`` under ``src/``, so a folder of modules without one would be left out of a wheel
(an editable install would still find it). Replaces the check that every package was listed by hand."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def test_the_packages_are_found_under_src() -> None:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tool["packages"]["find"]["where"] == ["src"]
    assert "package-dir" not in tool  # no remap: the import name is the folder


def test_every_folder_of_modules_under_src_is_a_package() -> None:
    missing = sorted(
        str(d.relative_to(ROOT))
        for d in SRC.rglob("*")
        if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py")) and not (d / "__init__.py").exists()
    )
    assert missing == [], f"folders of modules without __init__.py (a wheel would leave them out): {missing}"


def test_the_presets_ship_as_package_data() -> None:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tool["package-data"]["specdec.configs"] == ["*.yaml"]
    assert any((SRC / "specdec" / "configs").glob("*.yaml"))
