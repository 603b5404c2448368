"""The GPU gate's per-engine counter tables (``gate_report`` draws them under each TP's cells): specdec's own
counters per cell, and where each cell's wall went per engine."""

from __future__ import annotations

from typing import Any


def fmt(v: Any, spec: str, width: int) -> str:
    """``v`` formatted by ``spec`` right-aligned in ``width`` columns; '-' for None."""
    return ("-" if v is None else format(v, spec)).rjust(width)


# specdec's own counters per cell (rank 0's, first run; gate_worker.plugin_stats): which graphs its verify steps
# replayed and what the low-acceptance rule withheld, to read a cell's ratio from one run
PLUGIN_COLUMNS = (
    ("steps", "steps"),
    ("graphs.plain_full", "plain"),
    ("graphs.narrow_full", "narrow"),
    ("graphs.ragged_full", "ragged"),
    ("graphs.ragged_piecewise", "rag-pw"),
    ("graphs.narrow_piecewise", "nar-pw"),
    ("drafted_tokens", "drafted"),
    ("backoff_withheld_tokens", "withheld"),
    ("backoff_requests_backed_off", "off"),
)


def render_plugin(engine: dict[str, Any]) -> list[str]:
    """specdec's counters per cell (``PLUGIN_COLUMNS``), where the run recorded them."""
    cells = {k: c["runs"][0].get("plugin") for k, c in engine.get("cells", {}).items() if c.get("runs")}
    cells = {k: v[0] for k, v in cells.items() if v}
    if not cells:
        return []
    head = f"{'specdec':<11}" + "".join(f"{label:>9}" for _, label in PLUGIN_COLUMNS)
    lines = [head, "-" * len(head)]
    for key, d in cells.items():
        nums = "".join(fmt(d.get(k), ".0f", 9) for k, _ in PLUGIN_COLUMNS)
        lines.append(f"{key.replace('/', ' '):<11}{nums}")
    return [*lines, ""]


WALL_KEYS = (("first_tokens_s", "1st"), ("tail_s", "tail"))  # gate_metrics.wall_split's, as columns
WALL_WIDTH = 14
RATIO_WIDTH = WALL_WIDTH  # "specdec slow×" and a space


def render_walls(engines: dict[str, Any], methods: tuple[str, ...]) -> list[str]:
    """Where each cell's wall went (its first run's ``wall_split``, seconds summed over its closed batches: to the
    last first token, then the decode tail) per engine of ``methods`` that recorded it; nothing when none did. Then,
    per engine after the first (the reference), two ratios to the reference's first run: ``slow×``, its slowest
    request's first-to-last time (the closed batch's wall is that request's), and ``req×``, its requests' own decode
    rate (``request_tokens_per_s``: what the mean request gained)."""
    have = [m for m in methods if any(_split(c) for c in engines.get(m, {}).get("cells", {}).values())]
    if not have:
        return []
    head = f"{'wall s':<11}" + "".join(
        f"{_short(m) + ' ' + label:>{WALL_WIDTH}}" for m in have for _, label in WALL_KEYS
    )
    head += "".join(f"{_short(m) + ' ' + label:>{RATIO_WIDTH}}" for m in have[1:] for label in ("slow×", "req×"))
    lines = [head, "-" * len(head)]
    for key in dict.fromkeys(k for m in have for k in engines[m]["cells"]):
        firsts = [_first(engines[m]["cells"].get(key, {})) for m in have]
        splits = [f.get("wall_split") or {} for f in firsts]
        nums = "".join(fmt(sp.get(k), ".3f", WALL_WIDTH) for sp in splits for k, _ in WALL_KEYS)
        for f, sp in zip(firsts[1:], splits[1:]):
            nums += fmt(_ratio(sp.get("slowest_s"), splits[0].get("slowest_s")), ".2f", RATIO_WIDTH)
            nums += fmt(
                _ratio(f.get("request_tokens_per_s"), firsts[0].get("request_tokens_per_s")), ".2f", RATIO_WIDTH
            )
        lines.append(f"{key.replace('/', ' '):<11}{nums}")
    return [*lines, ""]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _first(cell: dict[str, Any]) -> dict[str, Any]:
    return (cell.get("runs") or [{}])[0]


def _split(cell: dict[str, Any]) -> dict[str, float] | None:
    return _first(cell).get("wall_split")


def _short(method: str) -> str:
    """A column's engine name: specdec-before as 'before'."""
    return method.removeprefix("specdec-")
