"""Typed, validated configuration objects.

Every config is a dataclass whose fields carry their allowed range in ``field(metadata=...)``.
``from_dict`` rejects unknown keys and out-of-range values with a message that names the key, the
value and what is allowed; ``load_yaml`` reads a preset from ``configs/`` or a path.

    @dataclass(frozen=True)
    class MyConfig(ConfigBase):
        depth: int = rng(24, lo=1, hi=128, doc="max draft depth")
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

import specdec.configs as _presets

T = TypeVar("T", bound="ConfigBase")
PRESET_DIR = Path(_presets.__file__).resolve().parent  # configs/ (installed as specdec.configs)


class ConfigError(ValueError):
    """A configuration key or value is not valid; the message names it and the fix."""


def rng(
    default: Any, *, lo: float | None = None, hi: float | None = None, choices: tuple | None = None, doc: str = ""
) -> Any:
    """A config field with an allowed range (inclusive) or a set of choices."""
    meta = {"lo": lo, "hi": hi, "choices": choices, "doc": doc}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def _allowed(meta: Mapping[str, Any]) -> str:
    if meta.get("choices"):
        return "one of " + ", ".join(repr(c) for c in meta["choices"])
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None and hi is not None:
        return f"in [{lo}, {hi}]"
    if lo is not None:
        return f">= {lo}"
    if hi is not None:
        return f"<= {hi}"
    return "any value"


def _coerce(name: str, value: Any, typ: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``typ`` (int/float/bool/str/Optional/list)."""
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for a in inner:
            try:
                return _coerce(name, value, a, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0])
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif typ is str:
        if isinstance(value, str):
            return value
    elif origin in (list, tuple):
        if isinstance(value, (list, tuple)):
            return list(value)
    elif typ is Any or origin is None and not isinstance(typ, type):
        return value
    else:
        return value
    tname = getattr(typ, "__name__", str(typ))
    raise ConfigError(f"{where}{name}={value!r} has the wrong type: expected {tname}")


@dataclass(frozen=True)
class ConfigBase:
    """Base of all typed configs; see the module docstring."""

    @classmethod
    def from_dict(cls: type[T], data: Mapping[str, Any] | None, *, where: str = "") -> T:
        data = dict(data or {})
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ConfigError(
                f"{where}unknown key(s) {', '.join(map(repr, unknown))} for {cls.__name__}; "
                f"valid keys: {', '.join(sorted(fields))}"
            )
        hints = typing.get_type_hints(cls)
        kwargs = {k: _coerce(k, v, hints[k], where) for k, v in data.items()}
        obj = cls(**kwargs)
        obj.validate(where=where)
        return obj

    def validate(self, *, where: str = "") -> None:
        for f in dataclasses.fields(self):
            meta = f.metadata
            value = getattr(self, f.name)
            if value is None or not meta:
                continue
            if meta.get("choices") and value not in meta["choices"]:
                raise ConfigError(f"{where}{f.name}={value!r} is not allowed: must be {_allowed(meta)}")
            lo, hi = meta.get("lo"), meta.get("hi")
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if numeric and ((lo is not None and value < lo) or (hi is not None and value > hi)):
                raise ConfigError(f"{where}{f.name}={value!r} is out of range: must be {_allowed(meta)}")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    def replace(self: T, **changes: Any) -> T:
        return type(self).from_dict({**self.to_dict(), **changes})

    @classmethod
    def describe(cls) -> str:
        """One line per key: name, default, allowed range and doc (for --help and errors)."""
        lines = []
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            lines.append(f"{f.name} (default {default!r}, {_allowed(f.metadata)}): {f.metadata.get('doc', '')}")
        return "\n".join(lines)


def load_yaml(name_or_path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML preset: a path, or a name in ``configs/`` (with or without ``.yaml``)."""
    path = Path(name_or_path)
    if not path.exists():
        cand = PRESET_DIR / (path.name if path.suffix else f"{path.name}.yaml")
        if not cand.exists():
            presets = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
            raise ConfigError(f"config {str(name_or_path)!r} not found as a file nor as a preset; presets: {presets}")
        path = cand
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data
