"""Build drafters from names, option dicts or lists (composition), with validated options."""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from specdec.config import ConfigError
from specdec.drafters.base import Drafter

# name -> "module:Class"; classes expose ``Config`` (a ConfigBase) and ``__init__(config)``.
_CLASSES: dict[str, str] = {
    "suffix": "specdec.drafters.suffix:SuffixDrafter",
    "ngram": "specdec.drafters.ngram:NgramDrafter",
    "model": "specdec.drafters.model:ModelDrafter",
    # peers, for benchmarks only
    "arctic": "specdec.eval.peers:ArcticDrafter",
    "vllm-ngram": "specdec.eval.peers:VllmNgramDrafter",
}
DRAFTER_NAMES = tuple(_CLASSES)

DrafterSpec = str | Mapping[str, Any] | Sequence[str | Mapping[str, Any]]


def drafter_names() -> tuple[str, ...]:
    """The names ``build_drafter`` knows (the registered ones, peers included)."""
    return tuple(_CLASSES)


def drafter_class(name: str) -> type[Drafter]:
    if name not in _CLASSES:
        raise ConfigError(f"drafter={name!r} is unknown; valid drafters: {', '.join(drafter_names())}")
    module, cls = _CLASSES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def check_repeats(parts: Sequence[tuple[str, Mapping[str, Any]]], *, where: str = "drafter") -> None:
    """Raise ``ConfigError`` if a composition lists one drafter twice with the same options (name, merged options):
    both would draft the same tokens at twice the CPU cost and memory. The same name with other options is allowed
    (``["suffix", {"name": "suffix", "max_depth": 8}]``)."""
    seen: list[tuple[str, dict[str, Any]]] = []
    for name, opts in parts:
        if (name, dict(opts)) in seen:
            raise ConfigError(
                f"{where}: {name!r} is listed twice with the same options; list each drafter once "
                f'(e.g. ["suffix", "model"])'
            )
        seen.append((name, dict(opts)))


def drafter_specs(spec: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, its own options) of every drafter in ``spec`` (a name, a dict with 'name', or a list of them; nested
    lists flattened; other values yield nothing: the build names them)."""
    if isinstance(spec, (list, tuple)):
        for part in spec:
            yield from drafter_specs(part)
    elif isinstance(spec, str):
        yield spec, {}
    elif isinstance(spec, Mapping):
        own = dict(spec)
        yield str(own.pop("name", "")), own


def build_drafter(spec: DrafterSpec, options: Mapping[str, Mapping[str, Any]] | None = None) -> Drafter:
    """Build a drafter.

    ``spec``: a name (``"suffix"``), a dict with ``name`` plus that drafter's options
    (``{"name": "suffix", "max_depth": 32}``), or a list of those (composition by score).
    ``options``: per-name option dicts merged under the spec's own (``{"model": {"path": ...}}``).
    """
    options = options or {}
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise ConfigError("drafter=[] is empty; give a name such as 'suffix' or a list like ['suffix', 'model']")
        check_repeats([(n, {**dict(options.get(n, {})), **own}) for n, own in drafter_specs(spec) if n])
        parts = [build_drafter(s, options) for s in spec]
        if len(parts) == 1:
            return parts[0]
        from specdec.drafters.compose import ComposedDrafter

        return ComposedDrafter(parts)
    if isinstance(spec, str):
        name, own = spec, {}
    elif isinstance(spec, Mapping):
        own = dict(spec)
        name = own.pop("name", None)
        if not isinstance(name, str):
            raise ConfigError(f"drafter={dict(spec)!r} needs a 'name' key naming one of {', '.join(DRAFTER_NAMES)}")
    else:
        raise ConfigError(f"drafter={spec!r} must be a name, a dict with 'name', or a list of those")
    cls = drafter_class(name)
    merged = {**dict(options.get(name, {})), **own}
    config = cls.Config.from_dict(merged, where=f"drafter {name!r}: ")  # type: ignore[attr-defined]
    return cls(config)
