"""Typed configs: presets load; unknown keys and bad values raise errors naming key, value and range."""

from __future__ import annotations

import pytest

from specdec.config import ConfigError, load_yaml
from specdec.generation import GenerateConfig


def test_preset_loads_and_matches_defaults():
    assert GenerateConfig.from_yaml("generate") == GenerateConfig()
    assert set(load_yaml("generate")) == set(GenerateConfig().to_dict())


def test_unknown_key_names_it_and_lists_valid_keys():
    with pytest.raises(ConfigError) as err:
        GenerateConfig.from_dict({"budgett": 3})
    msg = str(err.value)
    assert "'budgett'" in msg and "valid keys" in msg and "budget" in msg


@pytest.mark.parametrize(
    "key, value, allowed",
    [
        ("budget", 5000, "in [0, 1024]"),
        ("budget", -1, "in [0, 1024]"),
        ("temperature", -0.5, "in [0.0, 100.0]"),
        ("top_p", 0.0, "in [1e-06, 1.0]"),
        ("top_k", -3, "in [0, 1000000]"),
    ],
)
def test_out_of_range_names_key_value_and_range(key, value, allowed):
    with pytest.raises(ConfigError) as err:
        GenerateConfig.from_dict({key: value})
    msg = str(err.value)
    assert f"{key}={value!r}" in msg and allowed in msg and "out of range" in msg


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match=r"temperature='hot' has the wrong type: expected float"):
        GenerateConfig.from_dict({"temperature": "hot"})
    with pytest.raises(ConfigError, match=r"tree=1 has the wrong type"):
        GenerateConfig.from_dict({"tree": 1})


def test_yaml_file_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("budget: 9999\n")
    with pytest.raises(ConfigError, match=r"bad.yaml.*budget=9999 is out of range"):
        GenerateConfig.from_yaml(path)
    with pytest.raises(ConfigError, match="not found"):
        GenerateConfig.from_yaml("no-such-preset")


def test_replace_revalidates():
    cfg = GenerateConfig().replace(budget=16, tree=True)
    assert cfg.budget == 16 and cfg.tree
    with pytest.raises(ConfigError, match="budget=2000"):
        cfg.replace(budget=2000)
