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
import functools
import math
import numbers
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


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_number(
    name: str,
    value: Any,
    *,
    kind: type = int,
    lo: float | None = None,
    hi: float | None = None,
    above: float | None = None,
    where: str = "",
    hint: str = "",
) -> Any:
    """The one rule for numbers: ``value`` as an ``int`` (``kind=int``: integers only, never a float or a bool) or a
    finite ``float`` (``kind=float``: ints and floats, never NaN, infinity or a bool) in ``[lo, hi]``; else a
    ``ConfigError`` naming ``where`` + ``name`` (``name=value``, or ``--flag value`` for a flag), the value and the
    range (``above``: an exclusive lower bound; ``hint``: what to pass instead)."""
    if above is not None:
        allowed = f" in ({above}, {hi}]" if hi is not None else f" > {above}"
    else:
        allowed = _allowed({"lo": lo, "hi": hi})
        allowed = "" if allowed == "any value" else f" {allowed}"
    tail = f" ({hint})" if hint else ""
    given = f"{where}{name} {value!r}" if name.startswith("-") and " " not in name else f"{where}{name}={value!r}"
    if kind is int:
        if not _is_int(value):
            raise ConfigError(f"{given} has the wrong type: expected int{allowed}{tail}")
        value = int(value)
    else:
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise ConfigError(f"{given} has the wrong type: expected float{allowed}{tail}")
        try:
            value = float(value)
        except OverflowError:
            value = math.inf
        if not math.isfinite(value):
            raise ConfigError(f"{given} is not a finite number: must be{allowed or ' finite'}{tail}")
    low = (lo is not None and not value >= lo) or (above is not None and not value > above)
    if low or (hi is not None and not value <= hi):
        raise ConfigError(f"{given} is out of range: must be{allowed}{tail}")
    return value


def _coerce(name: str, value: Any, typ: Any, meta: Mapping[str, Any]) -> Any:
    """Check ``value`` against the annotation ``typ`` (int/float/bool/str/dict/list/Optional) and, for numbers,
    the field's range (``check_number``); returns the value as stored (ints widened to float for a float field)."""
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for a in inner:
            try:
                return _coerce(name, value, a, meta)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0])
    if typ in (int, float):
        return check_number(name, value, kind=typ, lo=meta.get("lo"), hi=meta.get("hi"))
    ok = {bool: bool, str: str, dict: Mapping}.get(typ)
    if ok is None and origin in (list, tuple) or typ in (list, tuple):
        ok = (list, tuple)
    if ok is None or isinstance(value, ok):
        return list(value) if ok == (list, tuple) else dict(value) if ok is Mapping else value
    tname = getattr(typ, "__name__", str(typ))
    raise ConfigError(f"{name}={value!r} has the wrong type: expected {tname}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@dataclass(frozen=True)
class ConfigBase:
    """Base of all typed configs; see the module docstring. Every instance is checked when it is made (typed,
    finite, in range), whether by ``from_dict`` or by the constructor."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            if f.init:
                object.__setattr__(self, f.name, _coerce(f.name, getattr(self, f.name), hints[f.name], f.metadata))
        self.validate()

    @classmethod
    def from_dict(cls: type[T], data: Mapping[str, Any] | None, *, where: str = "") -> T:
        if data is not None and not isinstance(data, Mapping):
            raise ConfigError(f"{where}expected a mapping of {cls.__name__} keys, got {data!r}")
        data = dict(data or {})
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - set(fields), key=str)
        if unknown:
            raise ConfigError(
                f"{where}unknown key(s) {', '.join(map(repr, unknown))} for {cls.__name__}; "
                f"valid keys: {', '.join(sorted(fields))}"
            )
        try:
            return cls(**data)
        except ConfigError as exc:
            raise ConfigError(f"{where}{exc}") from None

    def validate(self, *, where: str = "") -> None:
        """Choices (ranges and types are checked by ``_coerce`` when the instance is made); subclasses add
        checks across keys."""
        for f in dataclasses.fields(self):
            meta = f.metadata
            value = getattr(self, f.name)
            if value is not None and meta.get("choices") and value not in meta["choices"]:
                raise ConfigError(f"{where}{f.name}={value!r} is not allowed: must be {_allowed(meta)}")

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


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that gives one key twice (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        self.flatten_mapping(node)
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = lines.get(key)
            except TypeError:  # an unhashable key: the base class says so
                break
            if first is not None:
                where = f"lines {first} and {line}" if first != line else f"line {line}"
                raise ConfigError(
                    f"{key_node.start_mark.name}: key {key!r} is given twice ({where}); YAML would keep only the "
                    "last: give it once"
                )
            lines[key] = line
        return super().construct_mapping(node, deep=deep)


def yaml_value(text: str, *, source: str) -> Any:
    """``text`` parsed as YAML (duplicate keys refused: ``ConfigError`` naming ``source``); raises
    ``yaml.YAMLError`` for text that is not YAML."""
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("<unicode string>", source, 1)) from None


def load_yaml(name_or_path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML preset: a path, or a name in ``configs/`` (with or without ``.yaml``)."""
    path = Path(name_or_path)
    if not path.exists():
        cand = PRESET_DIR / (path.name if path.suffix else f"{path.name}.yaml")
        if not cand.exists():
            presets = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
            raise ConfigError(f"config {str(name_or_path)!r} not found as a file nor as a preset; presets: {presets}")
        path = cand
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.load(fh, Loader=UniqueKeyLoader) or {}  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data
