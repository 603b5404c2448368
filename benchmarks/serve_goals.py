"""The serving table's goals (#44 item 1), checked on serve_bench's runs: specdec's default against no speculation
and vLLM ``suffix`` in the same document, per dataset and rate.

- speculation's datasets (SPEC_DATASETS: agentic, code), at every rate below saturation (LOADED_RATES):
  TPOT p50 <= SUFFIX_TPOT_MAX x suffix's and <= no speculation's; TTFT p99 and ITL p99 <= TAIL_MAX x no
  speculation's;
- the same datasets at ``inf``: output tokens/s >= no speculation's and >= suffix's;
- the low-acceptance datasets (PLAIN_DATASETS: chat, random), at every rate: TPOT p50 <= (1 + PLAIN_TOL) x no
  speculation's and output tokens/s >= (1 - PLAIN_TOL) x its.

Every goal of the issue's table is judged, whichever datasets and rates a document holds: a goal whose runs are
missing (a dataset, method or rate not measured) is reported as MISSING, never as a pass. A rate run more than once
on the same servers (``--rates ...,inf,inf,inf``) is judged by the median of its repeats' ratios, each repeat paired
with the same repeat of the other method.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.gate_rules import ratio

CANDIDATE, PLAIN, PEER = "specdec", "nospec", "suffix"
SPEC_DATASETS = ("agentic", "code")
PLAIN_DATASETS = ("chat", "random")
LOADED_RATES = ("0.25R", "0.5R", "0.75R")
TABLE_RATES = (*LOADED_RATES, "R", "inf")  # the rates (serve_bench's default --rates)
SUFFIX_TPOT_MAX = 0.75
TAIL_MAX = 1.1
PLAIN_TOL = 0.03
REPEAT_MARK = "#"  # a rate run again on the same servers (serve_bench --rates inf,...,inf): "inf#2"


def _bench(runs: list[dict[str, Any]], method: str, dataset: str, label: str) -> dict[str, dict[str, Any]]:
    """``method``'s runs of ``dataset`` at the rate ``label``, each repeat by its label (``inf``, ``inf#2``, ...)."""
    out: dict[str, dict[str, Any]] = {}
    for r in runs:
        run_label = str(r["rate_label"])
        same_rate = run_label.split(REPEAT_MARK)[0] == label
        if (r["method"], r["dataset"]) == (method, dataset) and same_rate and r.get("bench"):
            out.setdefault(run_label, r["bench"])
    return out


Measured = tuple[float | None, list[float]]  # (the median of the repeats' ratios, each repeat's)


def _row(dataset: str, label: str, goal: str, measured: Measured, *, limit: float, at_most: bool) -> dict[str, Any]:
    value, repeats = measured
    if value is None:
        verdict = "MISSING"
    else:
        verdict = "PASS" if (value <= limit if at_most else value >= limit) else "FAIL"
    return {"dataset": dataset, "rate": label, "goal": goal, "ratio": value, "limit": limit,
            "at_most": at_most, "verdict": verdict, "repeats": repeats}  # fmt: skip


def _ratio(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]], key: str) -> Measured:
    """``a`` over ``b`` at each repeat both measured (the first run with the first, ``#2`` with ``#2``, ...), and
    their median: a run of a few seconds reads the server at one moment, and the median of paired repeats leans on
    no single one."""
    pairs = [ratio(a[label].get(key), b[label].get(key)) for label in a if label in b]
    repeats = [x for x in pairs if x is not None]
    return (statistics.median(repeats) if repeats else None), repeats


def goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per goal of the issue's table (SPEC_DATASETS and PLAIN_DATASETS at TABLE_RATES) on ``doc``
    (serve_bench's or serve_report's merged JSON)."""
    runs = doc.get("runs", [])
    rows: list[dict[str, Any]] = []
    for dataset in (*SPEC_DATASETS, *PLAIN_DATASETS):
        for label in TABLE_RATES:
            spec, plain, peer = (_bench(runs, m, dataset, label) for m in (CANDIDATE, PLAIN, PEER))
            if dataset in SPEC_DATASETS and label in LOADED_RATES:
                rows += [
                    _row(dataset, label, "TPOT p50 x suffix", _ratio(spec, peer, "p50_tpot_ms"),
                         limit=SUFFIX_TPOT_MAX, at_most=True),
                    _row(dataset, label, "TPOT p50 x nospec", _ratio(spec, plain, "p50_tpot_ms"),
                         limit=1.0, at_most=True),
                    _row(dataset, label, "TTFT p99 x nospec", _ratio(spec, plain, "p99_ttft_ms"),
                         limit=TAIL_MAX, at_most=True),
                    _row(dataset, label, "ITL p99 x nospec", _ratio(spec, plain, "p99_itl_ms"),
                         limit=TAIL_MAX, at_most=True),
                ]  # fmt: skip
            elif dataset in SPEC_DATASETS and label == "inf":
                rows += [
                    _row(dataset, label, "out tok/s x nospec", _ratio(spec, plain, "output_throughput"),
                         limit=1.0, at_most=False),
                    _row(dataset, label, "out tok/s x suffix", _ratio(spec, peer, "output_throughput"),
                         limit=1.0, at_most=False),
                ]  # fmt: skip
            elif dataset in PLAIN_DATASETS:
                rows += [
                    _row(dataset, label, "TPOT p50 x nospec", _ratio(spec, plain, "p50_tpot_ms"),
                         limit=1 + PLAIN_TOL, at_most=True),
                    _row(dataset, label, "out tok/s x nospec", _ratio(spec, plain, "output_throughput"),
                         limit=1 - PLAIN_TOL, at_most=False),
                ]  # fmt: skip
    return rows


def goals_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The goals as a table with a count of each verdict."""
    if not rows:
        return []
    lines = ["## Goals (specdec in the same run)", "", "| dataset | rate | goal | ratio | limit | verdict |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        if len(r.get("repeats", [])) > 1:  # the median of the repeats, each shown
            ratio += " (" + " / ".join(f"{x:.3f}" for x in r["repeats"]) + ")"
        limit = f"{'<=' if r['at_most'] else '>='} {r['limit']:.2f}"
        lines.append(f"| {r['dataset']} | {r['rate']} | {r['goal']} | {ratio} | {limit} | {r['verdict']} |")
    n = {v: sum(r["verdict"] == v for r in rows) for v in ("PASS", "FAIL", "MISSING")}
    summary = f"{n['PASS']} of {len(rows)} goals pass, {n['FAIL']} fail, {n['MISSING']} not measured."
    return [*lines, "", summary, ""]
