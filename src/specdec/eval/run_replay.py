"""The ``replay`` / ``sweep`` commands: datasets x drafter settings -> tables, JSON, plots, CSVs."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specdec.config import ConfigError
from specdec.eval.checks import check_draft_model_tokenizer, cpu_notes
from specdec.eval.common import EvalError, Staging, cost_model, echo, safe_name, settings_from_args
from specdec.eval.costmodel import CostModel
from specdec.eval.flags import check_flags
from specdec.eval.loaders import SHARED_TRACE_SETS, TraceError, load_traces, resolve_data_dir
from specdec.eval.records import TraceRecord
from specdec.eval.replay import replay
from specdec.eval.report import REPLAY_LEGEND, legend, wrap
from specdec.eval.results import build_document, results_path
from specdec.eval.settings import DEFAULT_DRAFTERS, Setting
from specdec.eval.tokenization import describe_tokenizer

logger = logging.getLogger("specdec.eval")
BUILT_IN = "built-in (specdec.eval.embedded)"  # the workload of specdec-eval with no data arguments
REPLAY_RULE = (
    "per step: accepted = longest draft path equal to the true continuation; emitted = accepted + 1 "
    "bonus token unless the response is complete; MAT = emitted / steps; drafter state persists "
    "across the records of a dataset (fresh drafter per dataset x setting), records in file order"
)


_UNAVAILABLE: set[str] = set()  # default drafters already reported as not importable


@dataclass
class DatasetJob:
    """A dataset to replay: its name, where it comes from, and a loader returning its records."""

    name: str
    source: str
    load: Callable[[], list[TraceRecord]]
    tokenizer: str = ""  # its short name (table titles); the results JSON's settings describe it whole
    workload: str = "traces"  # or "built-in workload"


def dataset_jobs(args: argparse.Namespace) -> list[DatasetJob]:
    """SOURCEs, else every shared set under --data/$SPECDEC_DATA, else the built-in workload."""
    sources = list(args.sources)
    if not sources and (args.data or os.environ.get("SPECDEC_DATA")):
        sources = [str(resolve_data_dir(args.data))]
    tok = describe_tokenizer(args.tokenizer)["name"]
    if not sources:
        return [replace(j, tokenizer=tok) for j in _embedded_jobs(args)]
    jobs: list[DatasetJob] = []
    for src in sources:
        path = Path(src).expanduser()
        if path.is_dir():
            jobs += _folder_jobs(path, args)
        else:
            jobs.append(_trace_job(src, args, data=args.data))
    names = [j.name for j in jobs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise EvalError(f"dataset name(s) {dup} appear twice; rename the files or pass each once")
    return [replace(j, tokenizer=tok) for j in jobs]


def _trace_job(src: str, args: argparse.Namespace, *, data: str | None) -> DatasetJob:
    from specdec.eval.loaders import resolve_source

    name, path = resolve_source(src, data)

    def load() -> list[TraceRecord]:
        return load_traces(
            src,
            tokenizer=args.tokenizer,
            limit=args.limit,
            data=data,
            fmt=args.format,
            all_turns=args.all_turns,
            use_cache=not args.no_cache,
            progress=not args.no_progress,
        )[1]

    return DatasetJob(name, str(path), load)


def _folder_jobs(path: Path, args: argparse.Namespace) -> list[DatasetJob]:
    shared = [n for n, rel in SHARED_TRACE_SETS.items() if (path / rel).exists()]
    if shared:
        return [_trace_job(n, args, data=str(path)) for n in shared]
    files = sorted(p for p in path.iterdir() if p.name.endswith((".jsonl", ".jsonl.gz")))
    if not files:
        raise TraceError(
            f"{path}: no trace sets found; expected the shared data folder (with "
            f"{next(iter(SHARED_TRACE_SETS.values()))}) or a folder of *.jsonl trace files"
        )
    return [_trace_job(str(f), args, data=None) for f in files]


def _embedded_jobs(args: argparse.Namespace) -> list[DatasetJob]:
    from specdec.eval.embedded import embedded_traces
    from specdec.eval.tokenization import NO_TOKENIZER

    if args.tokenizer == NO_TOKENIZER:
        raise EvalError(
            "--tokenizer none replays token-id traces only, and the built-in workload is text: give "
            "a SOURCE of prompt_ids/response_ids traces, or pass a tokenizer folder or 'bytes'"
        )
    sets = embedded_traces(args.tokenizer)
    if args.limit:
        sets = [(n, r[: args.limit]) for n, r in sets]
    return [DatasetJob(n, BUILT_IN, (lambda r=r: r), workload="built-in workload") for n, r in sets]


# ------------------------------------------------------------------------------------------- drafters
def _build(setting: Setting, *, explicit: bool):
    """The drafter for ``setting``, or None (with a warning) when a default drafter is not importable yet."""
    from specdec.drafters.registry import build_drafter

    try:
        return build_drafter(setting.spec, setting.options)
    except ImportError as exc:
        if explicit:
            raise EvalError(f"drafter {setting.drafter!r} cannot be imported ({exc})") from None
        if setting.drafter not in _UNAVAILABLE:
            _UNAVAILABLE.add(setting.drafter)
            logger.warning("drafter %s is not available (%s); skipped", setting.drafter, exc)
        return None
    except ConfigError as exc:
        raise EvalError(f"drafter {setting.drafter!r}: {exc}") from None


def _entry(job: DatasetJob, setting: Setting, result: Any, cm: CostModel, drafter: Any) -> dict[str, Any]:
    d = result.as_dict()
    d.update(cm.project(d))
    cfg = getattr(drafter, "config", None)
    where = {"dataset": job.name, "source": job.source, "workload": job.workload, "tokenizer": job.tokenizer}
    entry = {**where, **setting.describe(), **d}
    if cfg is not None and hasattr(cfg, "to_dict"):
        entry["drafter_config"] = cfg.to_dict()
    return entry


def run_replay(args: argparse.Namespace) -> int:
    check_flags(args)
    settings = settings_from_args(args)
    explicit = bool(args.drafter or args.config)
    cm = cost_model(args)
    jobs = dataset_jobs(args)
    check_draft_model_tokenizer(settings, args.tokenizer)
    saved = results_path(safe_name(args.save_results)) if args.save_results else None
    staging = Staging(args.out, files=[("--json", args.json), ("--save-results", saved and str(saved))])
    results: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        for job in jobs:
            results += _run_dataset(job, settings, args, cm, staging, explicit=explicit)
        if not results:
            raise EvalError(
                f"no drafter could run (tried {', '.join(s.drafter for s in settings)}); "
                f"install/implement one of {', '.join(DEFAULT_DRAFTERS)} or pass --drafter"
            )
        written = _write_outputs(args, settings, results, cm, staging, time.perf_counter() - t0)
    except BaseException:
        staging.abort()
        raise
    echo(args, legend(REPLAY_LEGEND))
    echo(args, wrap(f"cost model: {cm.describe()['formula']}; t(1) = {cm.base_ms:.2f} ms ({cm.source})"))
    for note in cpu_notes(results):
        echo(args, wrap(note))
    for p in written:
        echo(args, f"wrote {p}")
    return 0


def _run_dataset(
    job: DatasetJob,
    settings: list[Setting],
    args: argparse.Namespace,
    cm: CostModel,
    staging: Staging,
    *,
    explicit: bool,
) -> list[dict[str, Any]]:
    from specdec.eval.report import replay_tables

    t0 = time.perf_counter()
    records = job.load()
    if not records or all(r.response_ids.size == 0 for r in records):
        raise TraceError(f"{job.source}: empty dataset (no record with a non-empty response)")
    if not args.no_progress:
        print(f"[{job.name}] {len(records)} records loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    out = []
    for s in settings:
        drafter = _build(s, explicit=explicit)
        if drafter is None:
            continue
        csv_path = staging.path(f"steps_{safe_name(job.name)}_{safe_name(s.label)}.csv") if args.step_csv else None
        try:
            res = replay(
                drafter,
                records,
                budget=s.budget,
                tree=s.tree,
                progress=not args.no_progress,
                step_csv=csv_path,
                batch_size=args.batch_size,
                strict=args.strict,
                desc=f"{job.name[:20]} {s.label[:28]}",
            )
        finally:
            close = getattr(drafter, "close", None)
            if callable(close):
                close()
        out.append(_entry(job, s, res, cm, drafter))
    if out:
        echo(args, replay_tables(out) + "\n")
    return out


def _write_outputs(
    args: argparse.Namespace,
    settings: list[Setting],
    results: list[dict[str, Any]],
    cm: CostModel,
    staging: Staging,
    wall: float,
) -> list[Path]:
    import json

    from specdec.eval.report import plot_mat, plot_per_position
    from specdec.eval.results import atomic_write_text

    doc_settings = {
        "command": args.command,
        "workload": BUILT_IN if not args.sources and not (args.data or os.environ.get("SPECDEC_DATA")) else "traces",
        "tokenizer": describe_tokenizer(args.tokenizer),
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "drafter_settings": [s.describe() for s in settings],
        "cost_model": cm.describe(),
        "replay_rule": REPLAY_RULE,
        "wall_seconds": wall,
    }
    doc = build_document(doc_settings, results)
    text = json.dumps(doc, indent=1) + "\n"
    atomic_write_text(staging.path("results.json", args.json), text)
    if args.save_results:
        atomic_write_text(staging.path("saved.json", results_path(safe_name(args.save_results))), text)
    if not args.no_plots:
        plot_per_position(results, staging.path("per_position_acceptance.png"))
        plot_mat(results, staging.path("mat.png"))
    return staging.commit()
