"""Drafter settings for ``specdec-eval``: names, per-drafter options, YAML presets and sweep grids.

A *setting* is one drafter spec (a name, or names joined by ``+`` for a composition such as ``suffix+model``)
with its options, a budget and the tree flag. ``--option NAME.KEY=VALUE`` sets one option (VALUE is parsed as
YAML: ``32``, ``true``, ``[1, 2]``, ``text``); ``--grid KEY=V1,V2,...`` (sweep) takes the Cartesian product over
KEYs of the form ``NAME.KEY``, ``budget`` or ``tree``. A YAML preset (``--config``, a path or a name in
``configs/``) may hold::

    drafters: [suffix, ngram, suffix+model]     # or [[suffix, model]] for a composition
    options: {suffix: {max_depth: 32}}
    budget: 16                                  # or a list
    tree: false
    grid: {suffix.max_depth: [16, 32, 64], budget: [8, 16]}
    runs:                                       # explicit settings, run as listed (after the product)
      - {drafter: arctic, budget: 32, options: {max_depth: 64}}
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from specdec.config import ConfigError, load_yaml, yaml_value

DEFAULT_DRAFTERS = ("suffix", "ngram")
DEFAULT_BUDGET = 16
PRESET_KEYS = ("drafters", "options", "budget", "tree", "grid", "runs")
RUN_KEYS = ("drafter", "options", "budget", "tree")


@dataclass(frozen=True)
class Setting:
    """One drafter configuration to evaluate."""

    names: tuple[str, ...]  # one name, or several = composition
    options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per drafter name
    budget: int = DEFAULT_BUDGET
    tree: bool = False
    swept: dict[str, Any] = field(default_factory=dict)  # grid values that produced this setting

    @property
    def drafter(self) -> str:
        """``suffix`` / ``suffix+model``, with explicitly set options in brackets."""
        base = "+".join(self.names)
        opts = [
            f"{n}.{k}={v}" if len(self.names) > 1 else f"{k}={v}"
            for n in self.names
            for k, v in sorted(self.options.get(n, {}).items())
        ]
        return f"{base}[{','.join(opts)}]" if opts else base

    @property
    def label(self) -> str:
        return f"{self.drafter} b{self.budget}{' tree' if self.tree else ''}"

    @property
    def spec(self) -> str | list[str]:
        return self.names[0] if len(self.names) == 1 else list(self.names)

    def describe(self) -> dict[str, Any]:
        return {
            "drafter": self.drafter,
            "label": self.label,
            "names": list(self.names),
            "budget": self.budget,
            "tree": self.tree,
            "options": {n: dict(self.options.get(n, {})) for n in self.names},
            "swept": dict(self.swept),
        }


def parse_drafter(text: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(text, (list, tuple)):
        return tuple(str(t) for t in text)
    names = tuple(p.strip() for p in str(text).split("+") if p.strip())
    if not names:
        raise ConfigError(f"--drafter {text!r} is empty; give a name like suffix, ngram, model or suffix+model")
    return names


def parse_value(text: str, *, source: str = "--option") -> Any:
    """``text`` as YAML (``32``, ``true``, ``[1, 2]``), a mapping giving a key twice refused; text that is not YAML
    stays text."""
    try:
        return yaml_value(text, source=f"{source} {text!r}")
    except yaml.YAMLError:
        return text


def parse_assignment(text: str, *, flag: str) -> tuple[str, str]:
    if "=" not in text:
        raise ConfigError(f"{flag} {text!r} must look like KEY=VALUE (e.g. suffix.max_depth=32)")
    key, value = text.split("=", 1)
    return key.strip(), value.strip()


def parse_options(items: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``["suffix.max_depth=32"]`` -> ``{"suffix": {"max_depth": 32}}``."""
    out: dict[str, dict[str, Any]] = {}
    given: dict[str, str] = {}
    for item in items:
        key, value = parse_assignment(item, flag="--option")
        if "." not in key:
            raise ConfigError(f"--option {item!r}: the key must name the drafter, like suffix.{key}={value}")
        if key in given:
            raise ConfigError(f"--option {key} is given twice ({given[key]!r} and {item!r}); give it once")
        given[key] = item
        name, opt = key.split(".", 1)
        out.setdefault(name, {})[opt] = parse_value(value)
    return out


def parse_grid(items: Iterable[str]) -> dict[str, list[Any]]:
    """``["budget=8,16", "suffix.max_depth=16,32"]`` -> ordered dict of value lists."""
    grid: dict[str, list[Any]] = {}
    given: dict[str, str] = {}
    for item in items:
        key, value = parse_assignment(item, flag="--grid")
        if key in given:
            raise ConfigError(
                f"--grid {key} is given twice ({given[key]!r} and {item!r}); give it once with all its values"
            )
        given[key] = item
        if value.startswith("["):
            parsed = parse_value(value, source="--grid")
            values = list(parsed) if isinstance(parsed, list) else [parsed]
        else:
            parts = [v.strip() for v in value.split(",")]
            if any(not v for v in parts):
                raise ConfigError(
                    f"--grid {item!r} has an empty value; expected KEY=V1,V2,... like {key or 'budget'}=8,16"
                )
            values = [parse_value(v, source="--grid") for v in parts]
        if not values:
            raise ConfigError(f"--grid {item!r} has no values; expected KEY=V1,V2,... like budget=8,16")
        grid[key] = values
    return grid


def check_budget(value: Any, *, where: str) -> int:
    """``value`` as a budget (an integer >= 0) or a ConfigError naming ``where`` and the value."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}: budget={value!r} must be an integer >= 0 (e.g. budget=8,16)")
    return value


def check_tree(value: Any, *, where: str) -> bool:
    """``value`` as the tree flag (true/false) or a ConfigError naming ``where`` and the value."""
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: tree={value!r} must be true or false")
    return value


PRESET_SHAPES = {  # preset key -> (accepted types, what it should look like)
    "drafters": ((list, tuple), "a list of drafter names, e.g. [suffix, ngram]"),
    "options": (Mapping, "a mapping of drafter name -> options, e.g. {suffix: {max_depth: 32}}"),
    "budget": ((int, list, tuple), "an integer or a list of them"),
    "tree": ((bool, list, tuple), "true, false or a list of them"),
    "grid": (Mapping, "a mapping of KEY -> values, e.g. {suffix.max_depth: [16, 32]}"),
    "runs": ((list, tuple), "a list of mappings, e.g. [{drafter: suffix, budget: 16}]"),
}


def read_preset(name_or_path: str) -> dict[str, Any]:
    """A preset's mapping: known keys of the right shapes, no key both fixed and swept (``budget`` and
    ``grid: {budget: ...}``, ``options: {suffix: {max_depth}}`` and ``grid: {suffix.max_depth: ...}``)."""
    data = load_yaml(name_or_path)
    where = f"config {name_or_path!r}"
    unknown = sorted(set(data) - set(PRESET_KEYS), key=str)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys: {', '.join(PRESET_KEYS)}")
    for key, (types, shape) in PRESET_SHAPES.items():
        if data.get(key) is not None and not isinstance(data[key], types):
            raise ConfigError(f"{where}: {key}={data[key]!r} must be {shape}")
    for name, own in (data.get("options") or {}).items():
        if not isinstance(own, Mapping):
            raise ConfigError(f"{where}: options of drafter {name!r} must be a mapping, got {own!r}")
    fixed = {k: f"'{k}'" for k in ("budget", "tree") if data.get(k) is not None}
    fixed.update({f"{n}.{k}": f"'options: {n}: {k}'" for n, own in (data.get("options") or {}).items() for k in own})
    for key in data.get("grid") or {}:
        if str(key) in fixed:
            raise ConfigError(f"{where}: {key} is set by both {fixed[str(key)]} and 'grid'; keep one")
    return data


def _cli_grid(grid: Sequence[str], *, budgets: Sequence[int] | None, tree: bool | None, options: Sequence[str]) -> dict:
    """The ``--grid`` flags' values, none of them a setting fixed by another flag (``--grid budget=8`` with
    ``--budget 16`` ran 8 only)."""
    swept = parse_grid(grid)
    fixed = {"budget": f"--budget {' '.join(map(str, budgets))}"} if budgets else {}
    if tree is not None:
        fixed["tree"] = "--tree" if tree else "--no-tree"
    fixed.update({item.split("=", 1)[0].strip(): f"--option {item}" for item in options})
    written = {item.split("=", 1)[0].strip(): item for item in grid}
    for key in swept:
        if key in fixed:
            raise ConfigError(
                f"--grid {written[key]} and {fixed[key]} both set {key}: sweep it with --grid or fix it with "
                f"{fixed[key].split()[0]}, not both"
            )
    return swept


def _grid(data: Mapping[str, Any], cli: Mapping[str, list[Any]], cli_fixed: set[str]) -> dict[str, list[Any]]:
    """The preset's grid without the keys a flag fixes (flags override the preset), then the flags' grid."""
    own = {str(k): _as_list(v) for k, v in (data.get("grid") or {}).items() if str(k) not in cli_fixed}
    g = {**own, **cli}
    for key in g:
        if key not in ("budget", "tree") and "." not in key:
            raise ConfigError(f"grid key {key!r} must be budget, tree or NAME.KEY (e.g. suffix.max_depth)")
    g["budget"] = [check_budget(v, where="--grid") for v in g["budget"]] if "budget" in g else []
    g["tree"] = [check_tree(v, where="--grid") for v in g["tree"]] if "tree" in g else []
    return {k: v for k, v in g.items() if v or k not in ("budget", "tree")}


def _merge(base: Mapping[str, Mapping[str, Any]], over: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {k: dict(v) for k, v in base.items()}
    for k, v in over.items():
        out.setdefault(k, {}).update(v)
    return out


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def build_settings(
    *,
    drafters: Sequence[str] | None,
    options: Sequence[str] = (),
    budgets: Sequence[int] | None,
    tree: bool | None,
    grid: Sequence[str] = (),
    preset: str | None = None,
) -> list[Setting]:
    """All settings to run: flags override the preset; the grid multiplies everything."""
    data = read_preset(preset) if preset else {}
    names = [parse_drafter(d) for d in (drafters or data.get("drafters") or DEFAULT_DRAFTERS)]
    opts = _merge(data.get("options") or {}, parse_options(options))
    where = f"config {preset!r}" if preset else "--budget"
    budget_list = [
        check_budget(b, where=where if not budgets else "--budget")
        for b in (list(budgets) if budgets else _as_list(data.get("budget", DEFAULT_BUDGET)))
    ]
    trees = (
        [tree]
        if tree is not None
        else [check_tree(t, where=f"config {preset!r}") for t in _as_list(data.get("tree", False))]
    )
    cli_fixed = {k for k, on in (("budget", budgets), ("tree", tree is not None)) if on}
    cli_fixed |= {item.split("=", 1)[0].strip() for item in options}
    g = _grid(data, _cli_grid(grid, budgets=budgets, tree=tree, options=options), cli_fixed)
    settings: list[Setting] = []
    seen: set[str] = set()
    keys = list(g)
    explicit_runs = [_run(r, opts, preset) for r in data.get("runs") or []]
    if explicit_runs and not drafters and not data.get("drafters") and not keys:
        names = []  # a preset with only `runs` runs exactly those
    for combo in itertools.product(*(g[k] for k in keys)) if keys else [()]:
        values = dict(zip(keys, combo))
        for n in names:
            for b in [values["budget"]] if "budget" in values else budget_list:
                for t in [bool(values["tree"])] if "tree" in values else trees:
                    s = _one(n, opts, int(b), t, values)
                    if s.label not in seen:
                        seen.add(s.label)
                        settings.append(s)
    for s in explicit_runs:
        if s.label not in seen:
            seen.add(s.label)
            settings.append(s)
    check_names(settings, cli_options=options, grid_keys=[k for k in g if "." in k], preset_options=opts)
    check_options(settings)
    return settings


def check_options(settings: Sequence[Setting]) -> None:
    """Every setting's options pass its drafters' configs (unknown keys, ranges) before any data is loaded."""
    from specdec.drafters.registry import drafter_class

    for s in settings:
        for name in s.names:
            try:
                cls = drafter_class(name)
            except ImportError:
                continue  # an optional peer that is not installed: reported when it is built
            cls.Config.from_dict(dict(s.options.get(name, {})), where=f"drafter {name!r}: ")


def check_names(
    settings: Sequence[Setting],
    *,
    cli_options: Sequence[str],
    grid_keys: Sequence[str],
    preset_options: Mapping[str, Any],
) -> None:
    """Every drafter named in an option or a grid key exists, and those given as flags are run by a setting
    (a mistyped name such as ``sufix.max_depth`` would otherwise be ignored)."""
    from specdec.drafters.registry import drafter_names

    known = drafter_names()
    used = {n for s in settings for n in s.names}
    named = [(f"--option {item!r}", item.split("=", 1)[0].split(".", 1)[0].strip()) for item in cli_options]
    named += [(f"--grid key {key!r}", key.split(".", 1)[0]) for key in grid_keys]
    named += [(f"options of drafter {name!r}", name) for name in preset_options]
    for what, name in named:
        if name not in known:
            raise ConfigError(f"{what}: unknown drafter {name!r}; valid drafters: {', '.join(known)}")
        if name not in used and not what.startswith("options of"):
            raise ConfigError(
                f"{what}: drafter {name!r} is not among the drafters run ({', '.join(sorted(used))}); "
                f"add it to --drafter or drop the option"
            )


def _run(item: Any, opts: Mapping[str, Mapping[str, Any]], preset: str | None) -> Setting:
    """One entry of a preset's ``runs`` list; its ``options`` apply to its drafter(s) (or per name)."""
    if not isinstance(item, Mapping) or "drafter" not in item:
        raise ConfigError(f"config {preset!r}: each runs entry must be a mapping with a 'drafter' key, got {item!r}")
    unknown = sorted(set(item) - set(RUN_KEYS))
    if unknown:
        raise ConfigError(f"config {preset!r}: runs entry has unknown key(s) {unknown}; valid: {', '.join(RUN_KEYS)}")
    names = parse_drafter(item["drafter"])
    own = {n: dict(opts.get(n, {})) for n in names if opts.get(n)}
    extra = dict(item.get("options") or {})
    if extra and all(k in names and isinstance(v, Mapping) for k, v in extra.items()):
        for n, v in extra.items():
            own.setdefault(n, {}).update(v)
    elif extra:
        if len(names) != 1:
            raise ConfigError(
                f"config {preset!r}: options of the composition {item['drafter']!r} must be keyed by drafter name"
            )
        own.setdefault(names[0], {}).update(extra)
    budget = check_budget(item.get("budget", DEFAULT_BUDGET), where=f"config {preset!r}: runs entry")
    return Setting(names, own, budget, check_tree(item.get("tree", False), where=f"config {preset!r}: runs entry"))


def _one(
    names: tuple[str, ...], opts: Mapping[str, Mapping[str, Any]], budget: int, tree: bool, values: Mapping[str, Any]
) -> Setting:
    own = {n: dict(opts.get(n, {})) for n in names if opts.get(n)}
    swept = {}
    for key, v in values.items():
        if key in ("budget", "tree"):
            swept[key] = v
            continue
        name, opt = key.split(".", 1)
        if name in names:
            own.setdefault(name, {})[opt] = v
            swept[key] = v
    return Setting(names, own, budget, tree, swept)
