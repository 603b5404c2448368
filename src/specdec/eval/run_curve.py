"""``specdec-eval curve``: MAT against drafted tokens per step, each drafter swept through its own settings.

    specdec-eval curve --data ../shared/data --limit 400                      # suffix and arctic, default grids
    specdec-eval curve code_alpaca --drafter suffix arctic --split odd --grid suffix.min_token_prob=0.1,0.3

Per dataset, every drafter runs the settings of its grid (``--grid NAME.KEY=V1,V2``, else ``CURVE_GRIDS``) in one
replay (``specdec.eval.curve``); its curve is the upper envelope of its points, and the drafters are compared at
``--at`` drafted tokens per step against ``--versus`` (``specdec.eval.curve_report``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from specdec.config import ConfigError
from specdec.eval.common import EvalError, Staging, echo, safe_name
from specdec.eval.curve import SPLITS, group_settings, replay_settings
from specdec.eval.curve_report import DEFAULT_AT, MIN_CURVE_SETTINGS, compare, curve_table, curves, plot_curves
from specdec.eval.flags import check_flags
from specdec.eval.settings import DEFAULT_BUDGET, Setting, build_settings

DEFAULT_CURVE_DRAFTERS = ("suffix", "arctic")
# each drafter's own knobs, swept when no --grid names the drafter (the product of each dict's lists)
CURVE_GRIDS: dict[str, dict[str, list[Any]]] = {
    "arctic": {
        "max_depth": [24, 64],
        "max_spec_factor": [0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 16.0],
        "min_token_prob": [0.02, 0.1, 0.2, 0.4, 0.7],
    },
    "suffix": {
        "max_depth": [32, 64],
        "max_spec_factor": [1.0, 4.0, 16.0],
        "min_confidence": [0.003, 0.01, 0.03, 0.06, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 0.9],
    },
    "ngram": {"min_token_prob": [0.05, 0.1, 0.2, 0.4], "max_candidates": [1, 8], "budget": [4, 16]},
    "vllm-ngram": {"num_speculative_tokens": [1, 2, 3, 4, 6, 8, 12, 16], "max_n": [4, 8]},
}


def add_curve_parser(sub: Any, fmt: Any, add_trace_args: Callable, add_output_args: Callable) -> None:
    p = sub.add_parser(
        "curve", formatter_class=fmt, help="MAT against drafted tokens per step per drafter", description=__doc__
    )
    add_trace_args(p)
    g = p.add_argument_group("curve")
    g.add_argument(
        "--drafter",
        nargs="+",
        metavar="NAME",
        default=list(DEFAULT_CURVE_DRAFTERS),
        help=f"drafters, one curve each: NAME, or LABEL=NAME to sweep one drafter twice (before=suffix; its options "
        f"and grids are then LABEL.KEY) (default {' '.join(DEFAULT_CURVE_DRAFTERS)})",
    )
    g.add_argument("--option", action="append", default=[], metavar="NAME.KEY=VALUE", help="a fixed drafter option")
    g.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="NAME.KEY=V1,V2",
        help="a swept option of one drafter (repeatable; NAME.budget sweeps its budget); a drafter no --grid names "
        "sweeps its default grid (docs/eval.md)",
    )
    g.add_argument(
        "--budget", type=int, default=None, metavar="N", help=f"max draft tokens per step (default {DEFAULT_BUDGET})"
    )
    g.add_argument("--tree", action="store_true", help="tree drafts (default chains)")
    g.add_argument(
        "--split",
        choices=SPLITS,
        default="all",
        help="count only the records whose id's SHA-1 is even / odd (every record still warms the caches)",
    )
    g.add_argument(
        "--at",
        nargs="+",
        type=float,
        default=list(DEFAULT_AT),
        metavar="X",
        help="drafted tokens per step at which the curves are compared (default 2 4 8)",
    )
    g.add_argument("--versus", default="arctic", metavar="NAME", help="the curve the others are divided by")
    add_output_args(p)


def curve_labels(drafters: Sequence[str]) -> dict[str, str]:
    """``--drafter`` entries (``NAME`` or ``LABEL=NAME``) -> {label: drafter name}; labels are unique."""
    out: dict[str, str] = {}
    for item in drafters:
        label, _, name = str(item).partition("=") if "=" in str(item) else (str(item), "", str(item))
        if not label or not name or label in out:
            raise ConfigError(f"--drafter {item!r}: give NAME or LABEL=NAME, each label once (e.g. before=suffix)")
        out[label] = name
    return out


def curve_settings(args: argparse.Namespace) -> list[tuple[str, Setting]]:
    """(curve label, setting) of every drafter: its --grid entries or its default grid, times --option, --budget,
    --tree (options and grids of a labelled drafter are given as LABEL.KEY)."""
    labels = curve_labels(args.drafter)
    for item in [*args.option, *args.grid]:
        label = _label(item)
        if label not in labels:
            raise ConfigError(f"{item!r}: drafter {label!r} is not among --drafter ({', '.join(labels)})")
    out: list[tuple[str, Setting]] = []
    for label, name in labels.items():
        grid = [_own_key(g, label, name) for g in args.grid if _label(g) == label]
        if not grid:
            if name not in CURVE_GRIDS:
                key = f"{label}.{name.split('+')[0]}.KEY" if "+" in name else f"{label}.KEY"
                raise ConfigError(f"drafter {name!r} has no default curve grid; sweep it with --grid {key}=V1,V2")
            grid = [f"{name}.{k}={','.join(map(str, v))}" for k, v in CURVE_GRIDS[name].items()]
        budgets = [g for g in grid if g.split("=", 1)[0] in ("budget", f"{name}.budget")]
        grid = [g for g in grid if g not in budgets] + [f"budget={g.split('=', 1)[1]}" for g in budgets]
        settings = build_settings(
            drafters=[name],
            options=[_own_key(o, label, name) for o in args.option if _label(o) == label],
            # a grid that sweeps the budget sets it (with --budget as well: refused, naming both)
            budgets=[args.budget] if args.budget is not None else (None if budgets else [DEFAULT_BUDGET]),
            tree=args.tree,
            grid=grid,
        )
        out += [(label, s) for s in settings]
    return out


def _label(item: str) -> str:
    """The curve label a ``LABEL.KEY=V`` entry names."""
    return item.split("=", 1)[0].split(".", 1)[0].strip()


def _own_key(item: str, label: str, name: str) -> str:
    """``LABEL.KEY=V`` of a --grid or --option as the drafter's ``NAME.KEY=V`` (``budget=V`` for LABEL.budget); a
    composed drafter's entries name their part: ``LABEL.PART.KEY=V`` -> ``PART.KEY=V``."""
    if "." not in item.split("=", 1)[0] or "=" not in item:
        raise ConfigError(f"{item!r}: give {label}.KEY=VALUE (e.g. {label}.max_depth=32)")
    rest = item.split(".", 1)[1]
    if rest.split("=", 1)[0] == "budget":
        return rest
    if "+" not in name:
        return f"{name}.{rest}"
    parts = name.split("+")
    if rest.split(".", 1)[0] not in parts or "." not in rest.split("=", 1)[0]:
        raise ConfigError(
            f"{item!r}: drafter {name!r} composes {', '.join(parts)}; name the part, e.g. "
            f"{label}.{parts[0]}.{rest or 'KEY=V'}"
        )
    return rest


def run_curve(args: argparse.Namespace) -> int:
    from specdec.eval.run_replay import dataset_jobs

    check_flags(args)
    if args.batch_size != 1:
        raise EvalError(f"--batch-size {args.batch_size}: curve replays one record at a time (drop --batch-size)")
    labels = curve_labels(args.drafter)
    if args.versus and args.versus not in labels:
        raise EvalError(f"--versus {args.versus!r} is not among the curves ({', '.join(labels)})")
    settings = curve_settings(args)
    jobs = dataset_jobs(args)
    saved = None
    if args.save_results:
        from specdec.eval.results import results_path

        saved = results_path(safe_name(args.save_results))
    staging = Staging(args.out, files=[("--json", args.json), ("--save-results", saved and str(saved))])
    t0 = time.perf_counter()
    try:
        results: list[dict[str, Any]] = []
        for job in jobs:
            results += _curve_dataset(job, settings, args)
        written = _write(args, settings, results, staging, time.perf_counter() - t0)
    except BaseException:
        staging.abort()
        raise
    for path in written:
        echo(args, f"wrote {path}")
    return 0


def _curve_dataset(job: Any, labelled: Sequence[tuple[str, Setting]], args: argparse.Namespace) -> list[dict[str, Any]]:
    from specdec.drafters.registry import build_drafter, drafter_class

    records = job.load()
    settings = [s for _, s in labelled]
    out: list[dict[str, Any]] = [{}] * len(settings)
    bar = _bar(records, len(settings), args, job.name)
    for idx in group_settings(settings, lambda n: drafter_class(n).draft_options):
        group = [settings[i] for i in idx]
        try:
            drafter = build_drafter(group[0].spec, group[0].options)
        except (ConfigError, ImportError) as exc:
            raise EvalError(f"drafter {group[0].drafter!r}: {exc}") from None
        configs = [_config(s, drafter_class) for s in group]
        try:
            res = replay_settings(
                drafter, configs, group, records, split=args.split, progress=bar.update if bar else None
            )
        finally:
            getattr(drafter, "close", lambda: None)()
        for i, s, r in zip(idx, group, res):
            out[i] = {
                "dataset": job.name,
                "curve": labelled[i][0],
                "options": s.options,
                "budget": s.budget,
                **_point(r.as_dict()),
            }
    if bar is not None:
        bar.close()
    return out


POINT_KEYS = (
    "mat",
    "acceptance_rate",
    "drafted_per_step",
    "accepted_per_step",
    "steps",
    "drafted_tokens",
    "accepted_tokens",
    "emitted_tokens",
    "steps_with_draft",
    "records",
    "response_tokens",
    "draft_us_per_token",
)
POSITIONS_KEPT = 8  # per-position acceptance of a point: its first positions
DIGITS = 6  # significant digits of a point's floats (a curve file holds hundreds of points)


def _point(result: dict[str, Any]) -> dict[str, Any]:
    """What a curve keeps of one setting's replay: the counts, MAT, acceptance, drafting cost, early positions."""
    out = {k: float(f"{result[k]:.{DIGITS}g}") if isinstance(result[k], float) else result[k] for k in POINT_KEYS}
    out["per_position_acceptance"] = [round(v, 4) for v in result["per_position_acceptance"][:POSITIONS_KEPT]]
    return out


def _config(setting: Setting, drafter_class: Callable) -> Any:
    """The drafter config of a one-drafter setting (None for a composition, which shares no drafter)."""
    if len(setting.names) != 1:
        return None
    name = setting.names[0]
    return drafter_class(name).Config.from_dict(dict(setting.options.get(name, {})), where=f"drafter {name!r}: ")


def _markdown(doc: dict[str, Any], rows: Sequence[dict[str, Any]], args: argparse.Namespace) -> str:
    """The comparison table with the command and the versions that produced it."""
    from specdec.eval.curve_report import markdown_table

    v = doc["versions"]
    keep = ("specdec", "git", "arctic_inference", "numpy", "python", "cpu", "cpu_count")
    head = f"`{doc['command']}`\n\n" + ", ".join(f"{k} {v[k]}" for k in keep if k in v) + f"; {doc['device']}\n\n"
    return head + markdown_table(rows, at=args.at, versus=args.versus) + "\n"


def _bar(records: Sequence[Any], n_settings: int, args: argparse.Namespace, name: str) -> Any:
    if args.no_progress:
        return None
    from tqdm import tqdm

    print(f"[{name}] {len(records)} records, {n_settings} settings", file=sys.stderr)
    return tqdm(desc=name[:24], unit="tok", leave=False, dynamic_ncols=True)


def _write(
    args: argparse.Namespace,
    labelled: Sequence[tuple[str, Setting]],
    results: list[dict[str, Any]],
    staging: Staging,
    wall: float,
) -> list[Any]:
    from specdec.eval.results import atomic_write_text, build_document, results_path

    table = curves([dict(r, drafter=r["curve"]) for r in results])
    rows = compare(table, at=args.at, versus=args.versus)
    thin = sorted({f"{r['dataset']}/{r['drafter']}" for r in rows if r["settings"] < MIN_CURVE_SETTINGS})
    echo(args, curve_table(rows, at=args.at, versus=args.versus))
    if thin:
        echo(args, f"note: fewer than {MIN_CURVE_SETTINGS} settings in {', '.join(thin)}")
    doc_settings = {
        "command": "curve",
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "settings_per_curve": {label: sum(1 for lab, _ in labelled if lab == label) for label, _ in labelled},
        "wall_seconds": wall,
    }
    doc = build_document(doc_settings, results, extra={"curves": table, "comparison": rows})
    text = json.dumps(doc, separators=(",", ":")) + "\n"  # hundreds of points: one line
    atomic_write_text(staging.path("curve.json", args.json), text)
    md = _markdown(doc, rows, args)
    atomic_write_text(staging.path("curve.md"), md)
    if args.save_results:
        final = results_path(safe_name(args.save_results))
        atomic_write_text(staging.path("saved.json", final), text)
        atomic_write_text(staging.path("saved.md", final.with_suffix(".md")), md)
        if not args.no_plots:
            plot_curves(table, staging.path("saved.png", final.with_suffix(".png")), at=args.at)
    if not args.no_plots:
        plot_curves(table, staging.path("curve.png"), at=args.at)
    return staging.commit()
