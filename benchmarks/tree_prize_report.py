"""The tree prize's report: one row per (dataset, drafter, budget) with each tree arm's MAT ratio to the chain and
its paired-bootstrap interval, the decision rule (``--decide``) and the Markdown table."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

PRIZE_THRESHOLD = 1.08  # tree / chain MAT at a free budget that counts as a prize
BOOTSTRAP_DRAWS = 2000  # resamples of the records for the tree / chain interval


def ratio_ci(
    chain_steps: Sequence[int], tree_steps: Sequence[int], *, draws: int = BOOTSTRAP_DRAWS, seed: int = 0
) -> tuple[float, float]:
    """95% paired-bootstrap interval of MAT(tree) / MAT(chain) over records.

    Both arms emit every record's whole response, so the MAT ratio is steps(chain) / steps(tree) summed over the
    resampled records (lists aligned by record)."""
    c = np.asarray(chain_steps, np.float64)  # [records]
    t = np.asarray(tree_steps, np.float64)  # [records]
    if c.shape != t.shape or not c.size:
        raise ValueError(f"step lists must be aligned by record: {c.size} vs {t.size}")
    idx = np.random.default_rng(seed).integers(0, c.size, (draws, c.size))  # [draws, records]
    ratios = c[idx].sum(axis=1) / t[idx].sum(axis=1)  # [draws]
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return float(lo), float(hi)


def prize_rows(cells: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (dataset, drafter, budget): chain MAT, each tree arm's MAT, its ratio to the chain and (when both
    cells kept per-record steps) the ratio's 95% paired-bootstrap interval."""
    by: dict[tuple[str, str, int], dict[str, dict[str, Any]]] = {}
    for c in cells:
        by.setdefault((c["dataset"], c["drafter"], c["budget"]), {})[c["arm"]] = c
    rows = []
    for (ds, dr, b), arms in by.items():
        chain = arms.get("chain")
        row: dict[str, Any] = {"dataset": ds, "drafter": dr, "budget": b, "chain": chain and chain["mat"]}
        for arm in ("tree-own", "tree-static"):
            cell = arms.get(arm)
            row[arm] = cell and cell["mat"]
            row[f"{arm} / chain"] = cell["mat"] / chain["mat"] if cell and chain and chain["mat"] else None
            steps = (chain or {}).get("steps_by_record"), (cell or {}).get("steps_by_record")
            ok = steps[0] and steps[1] and len(steps[0]) == len(steps[1])
            row[f"{arm} ci95"] = ratio_ci(steps[0], steps[1]) if ok else None
        rows.append(row)
    return rows


def gains(
    rows: Sequence[dict[str, Any]], free: Sequence[int], *, threshold: float = PRIZE_THRESHOLD
) -> list[dict[str, Any]]:
    """The decision rule: every (dataset, drafter, budget, arm) at a ``free`` budget whose tree / chain MAT
    reaches ``threshold``. Empty: no drafter gains from trees, stop."""
    out = []
    for r in rows:
        if r["budget"] not in free:
            continue
        for arm in ("tree-own", "tree-static"):
            ratio = r.get(f"{arm} / chain")
            if ratio is not None and ratio >= threshold:
                out.append(
                    {
                        "dataset": r["dataset"],
                        "drafter": r["drafter"],
                        "budget": r["budget"],
                        "arm": arm,
                        "ratio": round(ratio, 4),
                    }
                )
    return out


def decide(path: Path, free: Sequence[int]) -> int:
    """Print the decision for the free budgets read off the GPU curve (``--decide``)."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    won = gains(prize_rows(doc["cells"]), free)
    if not won:
        print(f"free budgets {sorted(free)}: no drafter gains >= {PRIZE_THRESHOLD}x MAT from trees: stop")
        return 0
    for g in won:
        print(
            f"free budgets {sorted(free)}: {g['drafter']} on {g['dataset']} at B={g['budget']} ({g['arm']}): "
            f"{g['ratio']:.3f}x its chain"
        )
    return 0


def markdown(doc: dict[str, Any]) -> str:
    def f(v: Any, nd: int = 3) -> str:
        return "-" if v is None else f"{v:.{nd}f}"

    def ratio(r: dict[str, Any], arm: str) -> str:
        ci = r[f"{arm} ci95"]
        return f(r[f"{arm} / chain"]) + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")

    lines = [
        f"# Tree prize: tree vs chain MAT, same drafter, same budget ({doc['date']})",
        "",
        (
            f"Command: `{doc['command']}`; machine: {doc['machine']['cpu']} ({doc['machine']['cpu_count']} "
            f"cores); method: docs/trees.md (Method). Prize threshold: tree / chain >= {PRIZE_THRESHOLD}."
        ),
        "",
    ]
    sizes = doc["sizes"]
    lines += [
        f"Measured records: {sizes}",
        "",
        "| dataset | drafter | B | chain | tree-own | own / chain | tree-static | static / chain |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in doc["prize"]:
        lines.append(
            f"| {r['dataset']} | {r['drafter']} | {r['budget']} | {f(r['chain'])} | {f(r['tree-own'])} | "
            f"{ratio(r, 'tree-own')} | {f(r['tree-static'])} | {ratio(r, 'tree-static')} |"
        )
    lines += [
        "",
        (
            "Ratios: tree / chain MAT; in brackets its 95% paired bootstrap interval over records (cells that "
            "kept per-record steps)."
        ),
        "Static shapes (rank paths, best first) per (dataset, budget) are in the JSON (`shapes`).",
    ]
    return "\n".join(lines) + "\n"
