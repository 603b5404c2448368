"""MAT against drafted tokens per step: each drafter's upper envelope, comparisons at equal drafted tokens, table, PNG.

A point is one setting's (drafted tokens per step, MAT) on one dataset, steps without a draft included. A drafter's
curve is the upper envelope of its points: their upper concave hull from the fewest drafted tokens to the highest
MAT, joined by straight lines. A point on a segment is reached by mixing the two settings at its ends (each step, or
each request, drafted with one or the other), so the envelope does not depend on how densely a grid samples a knob.
Two drafters are compared at ``x`` drafted tokens per step only where ``x`` lies inside both curves' range (from the
fewest drafted tokens to the highest MAT); outside it the comparison is left empty.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specdec.eval.report import _f, _pyplot, format_table, group_by_dataset, save_png

Point = tuple[float, float]  # (drafted tokens per step, MAT)
DEFAULT_AT = (2.0, 4.0, 8.0)
MIN_CURVE_SETTINGS = 12  # the floor: a curve is the envelope of at least this many settings


def envelope(points: Sequence[Point]) -> list[Point]:
    """The upper concave hull of ``points`` from the smallest x to the highest y (its vertices, by x)."""
    rising: list[Point] = []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if not rising or y > rising[-1][1]:  # equal x: the highest y comes first
            rising.append((float(x), float(y)))
    hull: list[Point] = []
    for p in rising:
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) >= 0:  # hull[-1] on or below the chord
            hull.pop()
        hull.append(p)
    return hull


def _cross(o: Point, a: Point, b: Point) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def interpolate(curve: Sequence[Point], x: float) -> float | None:
    """MAT of ``curve`` at ``x`` drafted tokens per step (linear between envelope points); None outside its range."""
    if not curve or x < curve[0][0] or x > curve[-1][0]:
        return None
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else max(y0, y1)
    return curve[-1][1]


def curves(results: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """dataset -> drafter -> {"settings": n, "points": [(x, y)], "envelope": [(x, y)]}."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for ds, rows in group_by_dataset(results).items():
        per: dict[str, list[Point]] = {}
        for r in rows:
            per.setdefault(str(r["drafter"]), []).append((float(r["drafted_per_step"]), float(r["mat"])))
        out[ds] = {d: {"settings": len(p), "points": sorted(p), "envelope": envelope(p)} for d, p in per.items()}
    return out


def compare(
    table: Mapping[str, Mapping[str, Mapping[str, Any]]], *, at: Sequence[float] = DEFAULT_AT, versus: str = ""
) -> list[dict[str, Any]]:
    """Per dataset and drafter: MAT on the envelope at each ``at`` and its ratio to ``versus``'s (None where ``x``
    is outside either curve's range)."""
    rows = []
    for ds, per in table.items():
        ref = per.get(versus, {}).get("envelope") if versus else None
        for drafter, c in per.items():
            env = c["envelope"]
            row: dict[str, Any] = {
                "dataset": ds,
                "drafter": drafter,
                "settings": c["settings"],
                "range": [env[0][0], env[-1][0]] if env else None,
            }
            for x in at:
                mat = interpolate(env, x)
                base = interpolate(ref, x) if ref else None
                row[f"mat@{x:g}"] = mat
                row[f"ratio@{x:g}"] = mat / base if mat is not None and base else None
            rows.append(row)
    return rows


def curve_table(rows: Sequence[Mapping[str, Any]], *, at: Sequence[float] = DEFAULT_AT, versus: str = "") -> str:
    """One aligned table: dataset, drafter, settings, range of drafted tokens per step, MAT (and ratio) at each x."""
    cols: list = [
        ("dataset", "<", lambda r: r["dataset"], str),
        ("drafter", "<", lambda r: r["drafter"], str),
        ("settings", ">", lambda r: r["settings"], str),
        ("drafted/step range", ">", lambda r: r["range"], lambda v: "-" if not v else f"{v[0]:.2f}-{v[1]:.2f}"),
    ]
    for x in at:
        cols.append((f"MAT@{x:g}", ">", lambda r, x=x: r[f"mat@{x:g}"], _f(".3f")))
        if versus:
            cols.append((f"x {versus}@{x:g}", ">", lambda r, x=x: r[f"ratio@{x:g}"], _f(".3f")))
    return format_table(rows, cols)


def markdown_table(rows: Sequence[Mapping[str, Any]], *, at: Sequence[float] = DEFAULT_AT, versus: str = "") -> str:
    head = ["dataset", "drafter", "settings", "drafted/step range"]
    for x in at:
        head += [f"MAT@{x:g}"] + ([f"x {versus}@{x:g}"] if versus else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        rng = "-" if not r["range"] else f"{r['range'][0]:.2f}-{r['range'][1]:.2f}"
        cells = [r["dataset"], r["drafter"], str(r["settings"]), rng]
        for x in at:
            cells.append(_f(".3f")(r[f"mat@{x:g}"]))
            if versus:
                cells.append(_f(".3f")(r[f"ratio@{x:g}"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_curves(
    table: Mapping[str, Mapping[str, Mapping[str, Any]]],
    path: str | os.PathLike[str],
    *,
    at: Sequence[float] = DEFAULT_AT,
) -> Path:
    """One panel per dataset: each drafter's points (faint) and envelope (line); MAT on y, drafted/step on x."""
    plt = _pyplot()
    n = len(table)
    cols = min(3, n)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.9 * nrows), squeeze=False)
    for ax, (ds, per) in zip(axes.flat, table.items()):
        for i, (drafter, c) in enumerate(per.items()):
            color = f"C{i}"
            xs, ys = zip(*c["points"]) if c["points"] else ((), ())
            ax.scatter(xs, ys, s=8, alpha=0.35, color=color)
            ex, ey = zip(*c["envelope"]) if c["envelope"] else ((), ())
            ax.plot(ex, ey, marker="o", markersize=3, color=color, label=f"{drafter} ({c['settings']} settings)")
        for x in at:
            ax.axvline(x, color="gray", lw=0.6, ls=":")
        ax.set_title(ds, fontsize=10)
        ax.set_xlabel("drafted tokens per step (all steps)")
        ax.set_ylabel("MAT (tokens per step)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle("MAT against drafted tokens per step (upper envelope of each drafter's settings)", fontsize=11)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
    return Path(path)
