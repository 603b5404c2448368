"""The gate's before/after verdict (issue 41): does the candidate's default path (``specdec``) beat the base commit's
(``specdec-before``), both measured against the same no-speculation engine in one lease?

Per cell the two engines' ratios to no speculation are divided (candidate over before). A cell counts only where
both engines' outputs repeat like no speculation's: the 53M target loops on some prompts, and an engine whose bf16
outputs drift into a loop (greedy) or whose samples happen to loop more (sampled) drafts that loop well, which
speeds it up for reasons the change did not cause. Measured: the same base commit's sampled code cell ran 1.19-1.55x
no speculation when its outputs' repeated 4-grams were 0.43 against no speculation's 0.36, and the candidate 0.91x
at 0.18. Such a cell is shown and marked ``~``, not counted (``gate_rules.rep4_comparable``).

Beside it, the run's own noise floor: the cells where both engines did the same work (identical outputs, the same
drafted and accepted tokens) ran at candidate / before = 1 but for the noise between two engines; their spread is
what one run can resolve (docs/gate.md, "What one run resolves").

Over the counted cells of each TP: their geometric mean, each prompt set's, and the worst cell; with the serve
check's two TPOT ratios,
``gate_rules`` gives KEEP (the change may land as the default: it loses nothing past the noise and wins something)
or DROP.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks import gate_rules as rules
from benchmarks.gate_worker import base_method

CANDIDATE, BEFORE, REFERENCE = "specdec", "specdec-before", "nospec"


def pair_suffixes(row: dict[str, Any]) -> list[str]:
    """The before/after engine pairs of a cell's row: ``""`` for (specdec, specdec-before), ``".2"`` for
    (specdec.2, specdec-before.2), ... (replicas: a second pair in the same call, its GPUs swapped)."""
    found = [m[len(CANDIDATE) :] for m in row if base_method(m) == CANDIDATE]
    return sorted((x for x in found if isinstance(row.get(BEFORE + x), dict)), key=lambda x: (len(x), x))


def cell_pairs(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per cell both engines of at least one pair measured against no speculation (``cells``:
    ``gate_report.cell_row``'s rows): ``ratio`` (candidate / before, each over no speculation's speed; with several
    pairs the geometric mean of theirs, ``pairs``), ``emit`` (the same for emitted tokens per drafted step), every
    engine's ``rep4`` and ``comparable`` (all of them), and the pairs that did the same work (``same_work``: their
    ratios)."""
    rows = []
    for r in cells:
        suffixes = pair_suffixes(r) if r.get("nospec_tps") is not None else []
        if not suffixes:
            continue
        pairs = [(r[CANDIDATE + x], r[BEFORE + x]) for x in suffixes]
        ratios = [rules.ratio(c["x_nospec"], b["x_nospec"]) for c, b in pairs]
        rep4 = {REFERENCE: r.get("repeat4")}
        rep4.update({m + x: r[m + x].get("repeat4") for x in suffixes for m in (CANDIDATE, BEFORE)})
        c, b = pairs[0]
        rows.append(
            {
                "key": r["key"],
                "candidate": c["x_nospec"],
                "before": b["x_nospec"],
                "ratio": geomean(ratios) if all(ratios) else None,
                "pairs": ratios,
                "emit": geomean([rules.ratio(c["emit"], b["emit"]) for c, b in pairs]),
                "rep4": rep4,
                "comparable": rules.rep4_comparable(rep4[REFERENCE], *(v for k, v in rep4.items() if k != REFERENCE)),
                "same_work": [q for q, (c, b) in zip(ratios, pairs) if q and rules.same_work(c, b)],
            }
        )
    return rows


def geomean(values: list[float]) -> float | None:
    """Geometric mean of positive ``values`` (None when there are none)."""
    vals = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None


def noise_floor(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's noise between two engines: over the cells (and pairs) where both did the same work
    (``rules.same_work``: identical outputs, drafted and accepted tokens within a few percent) the count, geometric
    mean, lowest and highest candidate / before. Shown beside the verdict; the verdict does not use it."""
    ratios = [q for r in rows for q in r.get("same_work", [])]
    return {
        "cells": len(ratios),
        "geomean": geomean(ratios),
        "low": min(ratios, default=None),
        "high": max(ratios, default=None),
    }


def reference_of(servers: dict[str, Any], label: str) -> dict[str, Any]:
    """The no-speculation server ``label`` is judged against: its own call's (``reference``), else ``nospec``."""
    return servers.get(servers.get(label, {}).get("reference", REFERENCE), {})


def run_ratios(server: dict[str, Any], reference: dict[str, Any]) -> list[float]:
    """Median TPOT of each measured run over the reference's run of the same seed (one call: same traffic)."""
    pairs = zip(server.get("bench_runs", []), reference.get("bench_runs", []))
    return [r for a, b in pairs if (r := rules.ratio(a.get("median_tpot_ms"), b.get("median_tpot_ms"))) is not None]


def serve_ratio(server: dict[str, Any], reference: dict[str, Any]) -> float | None:
    """A server's median-TPOT ratio to no speculation: the median of its runs' ratios to the reference's runs of the
    same seeds (one run off, for whatever reason, does not move it), or the ratio of the two servers' means where
    runs were not kept."""
    runs = run_ratios(server, reference)
    if runs:
        return statistics.median(runs)
    return rules.ratio(server.get("bench", {}).get("median_tpot_ms"), reference.get("bench", {}).get("median_tpot_ms"))


def serve_pairs(serve: dict[str, Any]) -> dict[str, tuple[float | None, float | None]]:
    """Per TPOT check that served both (one per ``--serve-rate``): the (candidate, before) median-TPOT ratios to no
    speculation (``serve_ratio``), each against its own call's no-speculation server (``reference_of``)."""
    out = {}
    for name, check in serve.items():
        servers = check.get("servers", {})
        if check.get("kind") == "tpot" and BEFORE in servers:
            out[name] = tuple(serve_ratio(servers.get(m, {}), reference_of(servers, m)) for m in (CANDIDATE, BEFORE))
    return out  # type: ignore[return-value]


def compare(cells: dict[str, list[dict[str, Any]]], serve_checks: dict[str, Any]) -> dict[str, Any]:
    """The before/after summary: per TP (``cells``: TP -> ``gate_report.cell_row``'s rows) the cell pairs, their
    geometric mean, each prompt set's (``sets``) and the worst counted cell; the serve ratios (``serve_checks``: a
    results document's ``serve``); the verdict (``rules.NONE`` when no before engine ran)."""
    tps = {}
    for tp, tp_cells in sorted(cells.items()):
        rows = cell_pairs(tp_cells)
        counted = [r for r in rows if r["comparable"] and r["ratio"]]
        n_pairs = max((len(r["pairs"]) for r in rows), default=0)
        if rows:
            ratios = [r["ratio"] for r in counted]
            by_set: dict[str, list[float]] = {}
            for r in counted:
                by_set.setdefault(r["key"].split("/")[0], []).append(r["ratio"])
            sets = {name: geomean(values) for name, values in by_set.items()}
            tps[tp] = {
                "cells": rows,
                "geomean": geomean(ratios),
                "worst": min(ratios, default=None),
                "sets": sets,
                "same_work": noise_floor(rows),
                "pairs": [geomean([r["pairs"][i] for r in counted if len(r["pairs"]) > i]) for i in range(n_pairs)],
            }
    pairs = serve_pairs(serve_checks)  # every rate's: no loss at any, a win at one
    serve = next(iter(pairs.values()), (None, None))  # the first check's (the issue's rate where it ran)
    verdicts = [
        rules.before_after(t["geomean"], t["worst"], min(t["sets"].values(), default=None)) for t in tps.values()
    ]
    verdicts += [rules.before_after_serve(*pair) for pair in pairs.values() if pair[0] is not None]
    verdict = rules.overall(verdicts) if verdicts else rules.NONE
    geomeans = [t["geomean"] for t in tps.values()]
    win = any(rules.wins(geomeans, pair) for pair in pairs.values()) or rules.wins(geomeans, (None, None))
    reason = "a loss" if verdict == rules.FAIL else ("a win" if win else "no win")
    if verdict == rules.PASS and not win:
        verdict = rules.FAIL  # loses nothing, wins nothing: not worth a change to the default
    # TPs whose cells ran without a before engine: the verdict does not cover them, and the report says so
    uncompared = [tp for tp in sorted(cells) if tp not in tps or tps[tp]["geomean"] is None]
    if uncompared and verdict != rules.NONE:
        reason += f"; not compared: {', '.join(uncompared)} (no before engine)"
    return {
        "tps": tps,
        "serve": serve,
        "serve_checks": pairs,
        "win": win,
        "reason": reason,
        "verdict": verdict,
        "uncompared": uncompared,
    }


def _f(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def _abbr(key: str) -> str:
    """``agentic/b32`` -> ``ag32``, ``code/s8`` -> ``co-s8``: a column label."""
    name, cell = key.split("/", 1)
    return name[:2] + (cell[1:] if cell.startswith("b") else f"-{cell}")


def render_compare(result: dict[str, Any]) -> list[str]:
    """The before/after section of the gate's report (nothing when no before engine ran): per TP the geometric mean,
    the worst counted cell and every cell's candidate / before (``~``: not counted, its outputs repeat unlike no
    speculation's)."""
    if not result["tps"] and result["serve"][0] is None:
        return []
    out = ["", "== specdec / before (same run; ~: outputs repeat unlike nospec's, not counted) =="]
    keys = list(dict.fromkeys(r["key"] for t in result["tps"].values() for r in t["cells"]))
    w = max([5, *(len(tp) + 1 for tp in result["tps"])])  # the TP column: tp1, tp2, tp1_mml2048 (near-end inputs)
    head = f"{'':<{w}}{'geomean':>8}{'worst':>6} |" + "".join(f"{_abbr(k):>7}" for k in keys)
    out += [head, "-" * len(head)] if keys else []
    for tp, t in result["tps"].items():
        by = {r["key"]: r for r in t["cells"]}
        cells = "".join(
            f"{_f(by[k]['ratio']) + ('' if by[k]['comparable'] else '~'):>7}" if k in by else f"{'-':>7}" for k in keys
        )
        out.append(f"{tp:<{w}}{_f(t['geomean'], '.3f'):>8}{_f(t['worst']):>6} |{cells}")
        sets = ", ".join(f"{name} {_f(g, '.3f')}" for name, g in t.get("sets", {}).items())
        if sets:
            out.append(f"{'':<{w}}sets: {sets}")
        if len(t.get("pairs", [])) > 1:
            out.append(
                f"{'':<{w}}pairs (each a geomean; the cell is theirs): " + ", ".join(_f(g, ".3f") for g in t["pairs"])
            )
        same = t.get("same_work") or {}
        if same.get("cells"):
            out.append(
                f"{'':<{w}}same work (outputs identical, drafted and accepted within {rules.SAME_WORK_TOL:.0%}): "
                f"{same['cells']} cells, geomean {_f(same['geomean'], '.3f')}, {_f(same['low'])}-{_f(same['high'])}"
            )
    for name, (cand, base) in (result.get("serve_checks") or {"": result["serve"]}).items():
        if cand is not None:
            at = f" ({name})" if name else ""
            out.append(f"serve median TPOT x nospec{at}: specdec {_f(cand, '.3f')}, before {_f(base, '.3f')}")
    verdict = {rules.PASS: "KEEP", rules.FAIL: "DROP"}.get(result["verdict"], result["verdict"])
    out += [
        f"before/after: {verdict} ({result.get('reason', '-')})",
        f"KEEP: no loss (geomean >= {rules.KEEP_GEOMEAN_MIN} at every TP, each set's >= "
        f"{rules.KEEP_SET_GEOMEAN_MIN}, no cell < {rules.KEEP_CELL_FLOOR}, serve <= before + {rules.KEEP_SERVE_SLACK})",
        f"      and a win (a TP's geomean >= {rules.WIN_GEOMEAN}, or serve <= before - {rules.WIN_SERVE})",
    ]
    return out
