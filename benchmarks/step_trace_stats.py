"""Tables and plots of the vLLM benchmark's per-step traces (``step_trace``; columns in its docstring): steps by width
bucket (``summarise_trace``, ``format_rows``), the step-cost fit over near-full-width decode steps
(``fit_step_cost``), a cell's GPU busy and idle totals with heavy prefill steps apart (``cell_totals``,
``format_totals``) and the per-step plot (``plot_traces``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from specdec.eval.report import save_png
from specdec.vllm_plugin.patches.async_slots import PREFILL_HEAVY_TOKENS

WIDTH_EDGES = (1, 2, 4, 8, 16, 32, 48, 64, 128, 256)  # bucket upper bounds (requests per step)
MIN_FIT_STEPS = 8  # fit_step_cost needs at least this many steps


def _bucket(width: int) -> str:
    lo = 0
    for hi in WIDTH_EDGES:
        if width <= hi:
            return f"{lo + 1}-{hi}" if hi > lo + 1 else str(hi)
        lo = hi
    return f">{WIDTH_EDGES[-1]}"


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarise_trace(trace: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Rows per width bucket: steps, mean period/draft/busy/gap (ms), share of traced wall, non-full share."""
    n = len(trace["reqs"])
    total = sum(p for p in trace["period_ms"] if p is not None) or 1.0
    groups: dict[str, list[int]] = {}
    for i in range(n):
        groups.setdefault(_bucket(trace["reqs"][i]), []).append(i)
    names = ("period_ms", "draft_ms", "busy_ms", "gap_ms", "tokens", "spec", "emitted")
    columns = {c: trace.get(c) or [None] * n for c in names}  # older traces lack "emitted"
    rows = []
    for name, idx in sorted(groups.items(), key=lambda kv: -min(trace["reqs"][i] for i in kv[1])):
        col = {c: [columns[c][i] for i in idx] for c in names}
        cg = [trace["cg"][i] for i in idx]
        rows.append(
            {
                "width": name,
                "steps": len(idx),
                "wall_share": sum(p for p in col["period_ms"] if p is not None) / total,
                **{f"{c}_mean": _mean(col[c]) for c in names},
                "not_full_share": sum(c in "PN" for c in cg) / len(cg),
            }
        )
    return rows


DRAFT_SPLIT_COLS = (  # per step, ms: the period, GPU busy and idle, schedule mode's gap split, the loop's phases
    "period_ms",
    "busy_ms",
    "gap_ms",
    "held_ms",
    "after_ms",
    "sched_ms",
    "exec_ms",
    "sample_ms",
    "update_ms",
)


def summarise_by_draft(trace: dict[str, list[Any]], *, min_width: int = 2) -> list[dict[str, Any]]:
    """Decode steps at least ``min_width`` requests wide split by whether they verified a draft (``spec`` > 0):
    per kind, steps, width and draft tokens, each ``DRAFT_SPLIT_COLS`` mean, and the mean period of the step after
    (under async scheduling a step's cost can land in its successor's period). Prefill-heavy steps are left out, so
    the two kinds differ by their drafts, not by prompt work. Answers: what does a step that verifies a draft cost
    over a plain one, on the GPU (``busy_ms``) or on the host (the gap, the phases)?"""
    n = len(trace["reqs"])
    spec = trace.get("spec") or [0] * n
    tokens = trace.get("tokens") or [0] * n
    cols = {c: trace.get(c) or [None] * n for c in DRAFT_SPLIT_COLS}
    rows = []
    for kind, want in (("plain", False), ("drafted", True)):
        idx = [
            i
            for i in range(n)
            if trace["reqs"][i] >= min_width
            and tokens[i] - (spec[i] or 0) <= trace["reqs"][i]  # decode only: one new token per request past drafts
            and bool(spec[i]) is want
        ]
        if not idx:
            continue
        row: dict[str, Any] = {"kind": kind, "steps": len(idx), "width_mean": _mean([trace["reqs"][i] for i in idx])}
        row["spec_mean"] = _mean([spec[i] for i in idx])
        row |= {f"{c}_mean": _mean([cols[c][i] for i in idx]) for c in DRAFT_SPLIT_COLS}
        row["next_period_ms_mean"] = _mean([cols["period_ms"][i + 1] for i in idx if i + 1 < n])
        row["not_full_share"] = sum(trace["cg"][i] in "PN" for i in idx) / len(idx)
        rows.append(row)
    return rows


def format_draft_split(rows: list[dict[str, Any]]) -> str:
    """``summarise_by_draft``'s rows as a markdown table (ms means), a ratio row (drafted / plain) where both ran."""
    names = ["period", "busy", "gap", "held", "after", "sched", "exec", "sample", "update"]
    head = "| kind | steps | width | draft tokens | " + " | ".join(names) + " | next period | not full |"
    lines = [head, "| --- " * (len(names) + 6) + "|"]
    for r in rows:
        values = " | ".join(_fmt(r[f"{c}_mean"]) for c in DRAFT_SPLIT_COLS)
        lines.append(
            f"| {r['kind']} | {r['steps']} | {_fmt(r['width_mean'], 1)} | {_fmt(r['spec_mean'], 1)} | {values} | "
            f"{_fmt(r['next_period_ms_mean'])} | {_fmt(r['not_full_share'])} |"
        )
    if len(rows) == 2:
        plain, drafted = rows

        def x(key: str) -> str:
            a, b = plain.get(key), drafted.get(key)
            return "-" if not a or b is None else f"{b / a:.2f}x"

        ratios = " | ".join(x(f"{c}_mean") for c in DRAFT_SPLIT_COLS)
        lines.append(f"| drafted / plain | | | | {ratios} | {x('next_period_ms_mean')} | |")
    return "\n".join(lines)


def fit_step_cost(traces: list[dict[str, list[Any]]], *, min_width: int) -> dict[str, float] | None:
    """Least-squares fit over decode steps at least ``min_width`` requests wide (prefill steps left out):
    period = a + b x emitted tokens, and drafting = c + d x emitted. Returns a / c in ms, b / d in µs per token,
    R² of the period fit, the steps used and their throughput (emitted tokens / wall: the rate while the batch is
    full, which a closed batch's total hides); None without emitted counts or with fewer than MIN_FIT_STEPS steps."""
    import numpy as np

    rows = []
    for t in traces:
        emitted_col = t.get("emitted") or [None] * len(t["reqs"])  # older traces lack it
        for i, width in enumerate(t["reqs"]):
            period, emitted = t["period_ms"][i], emitted_col[i]
            prefill = t["tokens"][i] - t["spec"][i] != width
            if period is None or emitted is None or prefill or width < min_width:
                continue
            rows.append((emitted, period, t["draft_ms"][i] or 0.0, t["spec"][i]))
    if len(rows) < MIN_FIT_STEPS:
        return None
    data = np.array(rows, dtype=float)  # [steps, 4]: emitted, period ms, drafting ms, draft tokens
    tokens_per_s = 1e3 * float(data[:, 0].sum() / data[:, 1].sum())  # while the batch is (nearly) full
    if not data[:, 3].any():  # no step verified a draft (no speculation): no slope to fit
        return {
            "period_ms": float(data[:, 1].mean()),
            "period_us_per_token": None,
            "draft_ms": float(data[:, 2].mean()),
            "draft_us_per_token": None,
            "r2": None,
            "steps": len(data),
            "tokens_per_s": tokens_per_s,
        }
    design = np.stack([np.ones(len(data)), data[:, 0]], axis=1)  # [steps, 2]
    (a, b), *_ = np.linalg.lstsq(design, data[:, 1], rcond=None)
    (c, d), *_ = np.linalg.lstsq(design, data[:, 2], rcond=None)
    resid = data[:, 1] - design @ np.array([a, b])
    spread = ((data[:, 1] - data[:, 1].mean()) ** 2).sum()
    return {
        "period_ms": float(a),
        "period_us_per_token": 1e3 * float(b),
        "draft_ms": float(c),
        "draft_us_per_token": 1e3 * float(d),
        "r2": float(1 - (resid**2).sum() / spread) if spread else 1.0,
        "steps": len(data),
        "tokens_per_s": tokens_per_s,
    }


def cell_totals(trace: dict[str, list[Any]], *, heavy_tokens: int = PREFILL_HEAVY_TOKENS) -> dict[str, Any]:
    """A cell's GPU time in total: busy and idle seconds over all its steps, and the split between heavy prefill
    steps (prompt tokens ~ scheduled tokens - requests - draft tokens >= ``heavy_tokens``, the plugin's threshold
    by default) and the rest: their
    share of the steps, mean emitted tokens and GPU busy ms per step. Where every method does the same prefill
    work, ``busy_s`` says how much GPU work speculation saved and ``gap_s`` what the host added."""
    n = len(trace["reqs"])

    def col(name: str) -> list[float]:
        return [float(v) if v is not None else float("nan") for v in trace.get(name) or [None] * n]

    reqs, tokens, spec, emitted, busy, gap = (
        col(c) for c in ("reqs", "tokens", "spec", "emitted", "busy_ms", "gap_ms")
    )
    heavy = [t - r - s >= heavy_tokens for t, r, s in zip(tokens, reqs, spec)]

    def part(values: list[float], want: bool) -> float | None:
        return _mean([v for v, h in zip(values, heavy) if h == want and not math.isnan(v)])

    def total(ms: list[float]) -> float:  # seconds; NaN (not timed) skipped
        return sum(x for x in ms if not math.isnan(x)) / 1e3

    return {
        "steps": n,
        "busy_s": total(busy),
        "gap_s": total(gap),
        "gpu_s": total(busy) + total(gap),
        "emitted": int(sum(e for e in emitted if not math.isnan(e))),
        "heavy_share": sum(heavy) / n if n else None,
        "heavy_emitted": part(emitted, True),
        "light_emitted": part(emitted, False),
        "heavy_spec": part(spec, True),
        "heavy_busy_ms": part(busy, True),
        "light_busy_ms": part(busy, False),
    }


def format_totals(rows: dict[str, dict[str, Any]]) -> str:
    """``cell_totals`` of several cells (label -> totals) as a markdown table."""
    head = (
        "| cell | steps | GPU busy s | GPU idle s | sum s | heavy prefill steps | emitted / step heavy, rest | "
        "draft tokens / heavy step | busy ms / step heavy, rest |"
    )
    lines = [head, "| --- " * 9 + "|"]
    for label, t in rows.items():
        lines.append(
            f"| {label} | {t['steps']} | {_fmt(t['busy_s'])} | {_fmt(t['gap_s'])} | {_fmt(t['gpu_s'])} | "
            f"{_fmt(t['heavy_share'])} | {_fmt(t['heavy_emitted'], 1)}, {_fmt(t['light_emitted'], 1)} | "
            f"{_fmt(t['heavy_spec'], 0)} | {_fmt(t['heavy_busy_ms'], 1)}, {_fmt(t['light_busy_ms'], 1)} |"
        )
    return "\n".join(lines)


def _fmt(value: float | None, digits: int = 2) -> str:
    """A table cell: ``-`` for a missing value."""
    return "-" if value is None else f"{value:.{digits}f}"


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = (
        "| width | steps | wall share | period ms | draft ms | busy ms | gap ms | tokens | draft tokens | "
        "emitted | not full |"
    )
    lines = [head, "| --- " * 11 + "|"]
    f = _fmt
    for r in rows:
        lines.append(
            f"| {r['width']} | {r['steps']} | {f(r['wall_share'])} | {f(r['period_ms_mean'])} | "
            f"{f(r['draft_ms_mean'])} | {f(r['busy_ms_mean'])} | {f(r['gap_ms_mean'])} | "
            f"{f(r['tokens_mean'], 0)} | {f(r['spec_mean'], 0)} | {f(r['emitted_mean'], 0)} | "
            f"{f(r['not_full_share'])} |"
        )
    return "\n".join(lines)


def plot_traces(traces: dict[str, dict[str, list[Any]]], path: Path) -> None:
    """One panel per cell: per-step GPU busy, drafting and the rest of the host gap (stacked, ms) and the batch
    width (right axis), so the tail of stragglers and vLLM's own per-step host work are visible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(traces), 1, figsize=(10, 2.4 * len(traces)), squeeze=False, sharex=True)
    for ax, (key, t) in zip(axes[:, 0], traces.items()):
        n = len(t["reqs"])
        busy = [b or 0.0 for b in t["busy_ms"]]
        draft = [d or 0.0 for d in t["draft_ms"]]
        other = [max(0.0, (g or 0.0) - d) for g, d in zip(t["gap_ms"], draft)]
        xs = range(n)
        ax.bar(xs, busy, width=1.0, color="tab:green", label="GPU busy")
        ax.bar(xs, draft, width=1.0, bottom=busy, color="tab:red", label="drafting")
        ax.bar(
            xs,
            other,
            width=1.0,
            bottom=[b + d for b, d in zip(busy, draft)],
            color="tab:gray",
            label="other host work (GPU idle)",
        )
        ax.set_ylabel("ms per step")
        method, dataset, bs = key.split("|")
        ax.set_title(f"{method} / {dataset} / batch {bs}", fontsize=9, loc="left")
        width_ax = ax.twinx()
        width_ax.plot(xs, t["reqs"], color="black", linewidth=1.0)
        width_ax.set_ylabel("requests")
    axes[0, 0].legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("engine step")
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
