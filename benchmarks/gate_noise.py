"""What one before/after run of the GPU gate can resolve: the noise between two engines, pooled over earlier runs.

A greedy cell where the candidate and the base engine did the same work (``gate_rules.same_work``: identical outputs,
drafted and accepted tokens within a few percent) should run at candidate / before = 1; what it shows instead is the
noise between two engines. Pooled over every TP of every results file given, the log-ratios split into a run's
offset (every cell of one TP in one call moves together: ``between_run_sd``) and the cell's own scatter around it
(``within_run_sd``). From the two, the chance that a change doing nothing reads as a loss or a win under the
before/after rule (``gate_rules``) for a TP of ``--cells`` counted cells and a prompt set of ``--set-cells``:

    python -m benchmarks.gate_noise eval/results/A.json 4fd5f78c:eval/results/B.json ... --out eval/results/N.json

An argument ``<commit>:<path>`` is read from git (results files that left the tree).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
from pathlib import Path
from typing import Any

from benchmarks import gate_rules as rules
from benchmarks.gate_compare import cell_pairs, geomean
from benchmarks.gate_report import gate_verdicts

TP_CELLS = 12  # counted greedy cells of one TP in a full gate run (3 sets x 4 batches)
SET_CELLS = 4  # ... of one prompt set


def load(arg: str) -> dict[str, Any]:
    """A results document from a path, or from git as ``<commit>:<path>``."""
    if Path(arg).is_file():
        return json.loads(Path(arg).read_text())
    text = subprocess.run(["git", "show", arg], check=True, capture_output=True, text=True).stdout
    return json.loads(text)


def same_work_runs(docs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (file, TP) with a before engine: the same-work cells' keys and log-ratios (candidate / before)."""
    runs = []
    for name, doc in docs.items():
        for tp, gate in sorted(doc.get("gates", {}).items()):
            cells = {
                r["key"] + (f"#{i + 1}" if i else ""): math.log(q)  # one entry per same-work pair of the cell
                for r in cell_pairs(gate_verdicts(gate)["cells"])
                for i, q in enumerate(r["same_work"])
            }
            if cells:
                runs.append({"file": name, "tp": tp, "cells": cells})
    return runs


def split_variance(runs: list[dict[str, Any]]) -> tuple[float, float]:
    """(within-run SD, between-run SD) of the log-ratios: one-way random effects, method of moments."""
    groups = [list(r["cells"].values()) for r in runs]
    dof = sum(len(g) - 1 for g in groups)
    within = sum((x - statistics.fmean(g)) ** 2 for g in groups for x in g) / dof if dof else 0.0
    means = [statistics.fmean(g) for g in groups]
    n_bar = statistics.fmean(len(g) for g in groups)
    between = statistics.variance(means) - within / n_bar if len(means) > 1 else 0.0
    return math.sqrt(within), math.sqrt(max(between, 0.0))


def below(threshold: float, sd: float) -> float:
    """P(a log-normal geometric mean centred on 1 reads under ``threshold``) for log-SD ``sd``."""
    return 0.5 * math.erfc(-math.log(threshold) / (sd * math.sqrt(2))) if sd > 0 else 0.0


def null_change(within: float, between: float, *, tp_cells: int, set_cells: int) -> dict[str, float]:
    """What the before/after rule makes of a change that does nothing, per TP of ``tp_cells`` counted cells."""
    tp_sd = math.sqrt(between**2 + within**2 / tp_cells)
    set_sd = math.sqrt(between**2 + within**2 / set_cells)
    return {
        "tp_geomean_sd": tp_sd,
        "set_geomean_sd": set_sd,
        "p_tp_loss": below(rules.KEEP_GEOMEAN_MIN, tp_sd),  # geomean under KEEP_GEOMEAN_MIN
        "p_tp_win": 1.0 - below(rules.WIN_GEOMEAN, tp_sd),  # geomean at or above WIN_GEOMEAN
        "p_set_loss": below(rules.KEEP_SET_GEOMEAN_MIN, set_sd),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="gate results JSON: a path or <commit>:<path>")
    ap.add_argument("--cells", type=int, default=TP_CELLS, help="counted cells of one TP")
    ap.add_argument("--set-cells", type=int, default=SET_CELLS, help="counted cells of one prompt set")
    ap.add_argument("--out", type=Path, help="write the summary here (JSON)")
    args = ap.parse_args(argv)
    runs = same_work_runs({f: load(f) for f in args.files})
    if len(runs) < 2:
        ap.error(f"{len(runs)} runs with same-work cells in {len(args.files)} files: need at least 2")
    within, between = split_variance(runs)
    logs = [x for r in runs for x in r["cells"].values()]
    out = {
        "kind": "specdec-gate-noise",
        "command": "python -m benchmarks.gate_noise " + " ".join(args.files),
        "runs": [{**r, "geomean": geomean([math.exp(x) for x in r["cells"].values()])} for r in runs],
        "cells": len(logs),
        "geomean": math.exp(statistics.fmean(logs)),
        "low": math.exp(min(logs)),
        "high": math.exp(max(logs)),
        "within_run_sd": within,
        "between_run_sd": between,
        "null_change": null_change(within, between, tp_cells=args.cells, set_cells=args.set_cells),
    }
    print(render(out))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return out


def render(out: dict[str, Any]) -> str:
    lines = [f"{'run':<60}{'tp':>4}{'cells':>6}{'geomean':>9}", "-" * 79]
    lines += [f"{r['file'][-60:]:<60}{r['tp']:>4}{len(r['cells']):>6}{r['geomean']:>9.3f}" for r in out["runs"]]
    n = out["null_change"]
    lines += [
        "",
        f"{out['cells']} same-work cells in {len(out['runs'])} runs: geomean {out['geomean']:.3f}, "
        f"{out['low']:.3f}-{out['high']:.3f}; log SD within a run {out['within_run_sd']:.3f}, "
        f"between runs {out['between_run_sd']:.3f}",
        f"a change that does nothing: TP geomean SD {n['tp_geomean_sd']:.3f} -> reads as a loss "
        f"(< {rules.KEEP_GEOMEAN_MIN}) {n['p_tp_loss']:.0%}, as a win (>= {rules.WIN_GEOMEAN}) {n['p_tp_win']:.0%} "
        f"per TP; a set's geomean < {rules.KEEP_SET_GEOMEAN_MIN} {n['p_set_loss']:.0%} per set",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
