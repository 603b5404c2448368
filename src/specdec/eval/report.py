"""Terminal tables and PNG plots of eval results (result dicts as written to the results JSON)."""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

POSITIONS_SHOWN = 4  # per-position acceptance columns in the terminal table
MAX_CURVE_POSITIONS = 32
FIG_DPI = 110
PNG_COLORS = 256  # save_png's palette
MAX_WIDTH = 120  # terminal tables and their notes fit this many columns

Row = Mapping[str, Any]


def _f(fmt: str) -> Callable[[Any], str]:
    def render(v: Any) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        return format(v, fmt)

    return render


Column = tuple[str, str, Callable[[Row], Any], Callable[[Any], str]]  # header, alignment, value, rendering

REPLAY_COLUMNS: list[Column] = [
    ("drafter", "<", lambda r: r.get("drafter", r.get("label")), str),
    ("budget", ">", lambda r: r.get("budget"), str),
    ("tree", ">", lambda r: "y" if r.get("tree") else "n", str),
    ("MAT", ">", lambda r: r.get("mat"), _f(".3f")),
    ("accept", ">", lambda r: r.get("acceptance_rate"), _f(".3f")),
    ("drafted", ">", lambda r: r.get("drafted_per_step"), _f(".2f")),
    ("pos 1-4", "<", lambda r: r.get("per_position_acceptance"), lambda v: _positions(v)),
    ("draft us", ">", lambda r: r.get("draft_us_per_token"), _f(".2f")),
    ("update us", ">", lambda r: r.get("update_us_per_token"), _f(".2f")),
    ("speedup", ">", lambda r: r.get("projected_speedup"), lambda v: "-" if v is None else f"{v:.2f}x"),
    ("errors", ">", lambda r: (r.get("draft_errors") or 0) + (r.get("budget_violations") or 0), str),
]
REPLAY_LEGEND = {
    "drafter": "the drafter, with the options set (a+b: a composition)",
    "budget": "most draft tokens per request per step",
    "tree": "y: token trees, n: chains",
    "MAT": "tokens emitted per verify step, bonus token included",
    "accept": "accepted / drafted tokens",
    "drafted": "draft tokens per step",
    "pos 1-4": "acceptance at draft positions 1 to 4",
    "draft us": "CPU microseconds spent drafting per emitted token",
    "update us": "CPU microseconds per emitted token spent feeding it to the drafter",
    "speedup": "projected by the cost model (line below)",
    "errors": "drafter failures + budget violations",
}


def _positions(values: Sequence[float] | None) -> str:
    if not values:
        return "-"
    return " ".join(f"{v:.2f}" for v in list(values)[:POSITIONS_SHOWN])


def format_table(rows: Sequence[Row], columns: Sequence[Column], *, title: str = "", width: int = MAX_WIDTH) -> str:
    """Aligned plain-text table (title, header, rule, one line per row) at most ``width`` characters wide: the first
    column is cut (ending in ``~``) where it would be wider; the results JSON holds it whole."""
    cells = [[render(get(r)) for _, _, get, render in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (h, _, _, _) in enumerate(columns)]
    over = sum(widths) + 2 * (len(widths) - 1) - width
    if over > 0:
        widths[0] = max(len(columns[0][0]), widths[0] - over)
        for c in cells:
            c[0] = c[0] if len(c[0]) <= widths[0] else c[0][: widths[0] - 1] + "~"

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if a == "<" else v.rjust(w) for v, w, (_, a, _, _) in zip(values, widths, columns))

    out = [textwrap.shorten(title, width, placeholder="...")] if title else []
    out += [line([h for h, _, _, _ in columns]), "  ".join("-" * w for w in widths)]
    out += [line(c) for c in cells]
    return "\n".join(out)


def wrap(text: str, *, width: int = MAX_WIDTH) -> str:
    """A note wrapped to ``width`` columns (continuation lines indented)."""
    return textwrap.fill(text, width, subsequent_indent="  ", break_on_hyphens=False)


def legend(explained: Mapping[str, str], *, width: int = MAX_WIDTH) -> str:
    """Each column's meaning, once, wrapped to ``width``."""
    text = "; ".join(f"{k}: {v}" for k, v in explained.items())
    return wrap("columns: " + text, width=width)


def group_by_dataset(results: Iterable[Row]) -> dict[str, list[Row]]:
    groups: dict[str, list[Row]] = {}
    for r in results:
        groups.setdefault(str(r.get("dataset", "?")), []).append(r)
    return groups


def replay_tables(results: Sequence[Row]) -> str:
    """One table per dataset, with its record/token counts in the title."""
    parts = []
    for ds, rows in group_by_dataset(results).items():
        first = rows[0]
        title = (
            f"== {ds}: {first.get('records', '?')} records, {first.get('response_tokens', 0):,} response "
            f"tokens, {first.get('prompt_tokens', 0):,} prompt tokens; {first.get('workload', 'traces')}, tokenizer "
            f"{first.get('tokenizer', '?')}"
        )
        parts.append(format_table(rows, REPLAY_COLUMNS, title=title))
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------------------- plots
def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: Path | str, *, dpi: int = FIG_DPI) -> None:
    """``fig`` as a PNG of at most PNG_COLORS colours (a palette image: a third of the bytes of the RGBA one for
    line plots, whose few colours and their anti-aliasing fit the palette; kept results have a size budget)."""
    import io

    from PIL import Image  # matplotlib's own dependency

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(PNG_COLORS).save(path, format="PNG", optimize=True)


def plot_per_position(
    results: Sequence[Row],
    path: str | os.PathLike[str],
    *,
    title: str = "Per-position acceptance (trace replay, greedy verification)",
) -> Path:
    """Per-position acceptance curves: one panel per dataset, one line per drafter setting."""
    plt = _pyplot()
    groups = group_by_dataset(results)
    n = len(groups)
    cols = min(3, n)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.8 * nrows), squeeze=False)
    for ax, (ds, rows) in zip(axes.flat, groups.items()):
        for r in rows:
            acc = list(r.get("per_position_acceptance") or [])[:MAX_CURVE_POSITIONS]
            if acc:
                ax.plot(
                    range(1, len(acc) + 1),
                    acc,
                    marker="o",
                    markersize=3,
                    label=f"{r.get('label', r.get('drafter'))} (MAT {r.get('mat', 0):.2f})",
                )
        ax.set_title(ds, fontsize=10)
        ax.set_xlabel("draft position k")
        ax.set_ylabel("P(accept k | drafted k)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no drafts", ha="center", va="center", transform=ax.transAxes, color="gray")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
    return Path(path)


def plot_mat(
    results: Sequence[Row],
    path: str | os.PathLike[str],
    *,
    key: str = "mat",
    ylabel: str = "MAT (tokens per step, bonus included)",
) -> Path:
    """Grouped bars: ``key`` per dataset (groups) and drafter setting (bars)."""
    plt = _pyplot()
    groups = group_by_dataset(results)
    labels: list[str] = []
    for rows in groups.values():
        for r in rows:
            lab = str(r.get("label", r.get("drafter")))
            if lab not in labels:
                labels.append(lab)
    width = 0.8 / max(len(labels), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups) * max(1, len(labels)) ** 0.5 + 2), 4.2))
    for j, lab in enumerate(labels):
        xs, ys = [], []
        for i, rows in enumerate(groups.values()):
            match = [r for r in rows if str(r.get("label", r.get("drafter"))) == lab]
            if match and match[0].get(key) is not None:
                xs.append(i + (j - (len(labels) - 1) / 2) * width)
                ys.append(float(match[0][key]))
        bars = ax.bar(xs, ys, width=width, label=lab)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(list(groups), rotation=15, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    if key == "mat":
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(f"{ylabel.split(' (')[0]} per dataset and drafter", fontsize=11)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
    return Path(path)
