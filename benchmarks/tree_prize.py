"""The tree prize: tree vs chain MAT of the same drafter at the same budget, by the method of docs/trees.md.

    python -m benchmarks.tree_prize                       # all drafters, both sets, budgets 1..64
    python -m benchmarks.tree_prize --drafters suffix --out-name 2026-11-26_cpu-2core_tree_prize

Arms per drafter and budget B: ``chain`` (the drafter's own chain), ``tree-own`` (its own per-request tree) and,
for the drafters in ``--static-for``, ``tree-static``: a static shape of rank paths chosen on a calibration slice
disjoint from the measured one (``acceptance_table`` -> ``static_shape``), applied by pruning the drafter's own
tree at a pool budget (``ShapedDrafter``). Writes JSON (command, versions, machine, every replay's totals) and a
Markdown table to eval/results/.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.tree_prize_report import decide, markdown, prize_rows
from benchmarks.tree_prize_shapes import (
    RankPath,
    RankStats,
    RecordingDrafter,
    ShapedDrafter,
    StepCounter,
    acceptance_table,
    pool_budget,
    static_shape,
)
from specdec.drafters.base import Drafter
from specdec.eval.records import TraceRecord

BUDGETS = (1, 2, 4, 8, 16, 32, 64)
AGENTIC_CAL_INSTANCES = 5  # OpenHands instances (groups) in the calibration slice
CODE_CAL_RECORDS = 300  # code_alpaca records in the calibration slice
HEAVY_DRAFTERS = ("model", "suffix+model")  # draft-model drafters: smaller measured slices, batched replay
HEAVY_BATCH = 16  # requests replayed at once for HEAVY_DRAFTERS


# ----------------------------------------------------------------------------- slices and runs
@dataclass
class Slices:
    name: str  # dataset name
    calibration: list[TraceRecord]
    measured: list[TraceRecord]
    measured_heavy: list[TraceRecord]


def load_slices(*, agentic_n: int, code_n: int, agentic_heavy: int, code_heavy: int) -> list[Slices]:
    from specdec.eval.loaders import load_traces

    _, ag = load_traces("openhands_swebench")
    groups = list(dict.fromkeys(r.group for r in ag))
    cal_groups = set(groups[:AGENTIC_CAL_INSTANCES])
    ag_cal = [r for r in ag if r.group in cal_groups]
    ag_rest = [r for r in ag if r.group not in cal_groups]
    _, code = load_traces("code_alpaca")
    code_rest = code[CODE_CAL_RECORDS:]
    return [
        Slices("openhands_swebench", ag_cal, ag_rest[:agentic_n], ag_rest[:agentic_heavy]),
        Slices("code_alpaca", code[:CODE_CAL_RECORDS], code_rest[:code_n], code_rest[:code_heavy]),
    ]


def make_drafter(spec: str, model_options: dict[str, Any]) -> Drafter:
    from specdec.drafters.registry import build_drafter

    names = spec.split("+")
    return build_drafter(names[0] if len(names) == 1 else names, {"model": model_options})


def _replay(drafter: Drafter, records: Sequence[TraceRecord], *, budget: int, tree: bool, batch: int) -> dict[str, Any]:
    from specdec.eval.replay import replay

    try:
        res = replay(drafter, records, budget=budget, tree=tree, batch_size=batch)
    finally:
        drafter.close()
    return res.as_dict()


def calibrate(
    spec: str, records: Sequence[TraceRecord], budget: int, *, batch: int, model_options: dict[str, Any]
) -> tuple[list[RankPath], np.ndarray]:
    """The static shape for ``budget`` from pool trees replayed over the calibration ``records``."""
    stats = RankStats()
    _replay(
        RecordingDrafter(make_drafter(spec, model_options), stats),
        records,
        budget=pool_budget(budget),
        tree=True,
        batch=batch,
    )
    p = acceptance_table(stats)
    return static_shape(p, budget), p


def run_cell(
    spec: str,
    sl: Slices,
    budget: int,
    arm: str,
    *,
    model_options: dict[str, Any],
    shape: Sequence[RankPath] | None = None,
) -> dict[str, Any]:
    heavy = spec in HEAVY_DRAFTERS
    records = sl.measured_heavy if heavy else sl.measured
    batch = HEAVY_BATCH if heavy else 1
    drafter = make_drafter(spec, model_options)
    if arm == "tree-static":
        drafter = ShapedDrafter(drafter, shape or [])
    counter = StepCounter(drafter)
    t0 = time.perf_counter()
    d = _replay(counter, records, budget=budget, tree=arm != "chain", batch=batch)
    keep = (
        "mat",
        "steps",
        "emitted_tokens",
        "accepted_tokens",
        "drafted_tokens",
        "records",
        "response_tokens",
        "draft_errors",
        "budget_violations",
        "per_position_acceptance",
    )
    out = {
        "dataset": sl.name,
        "drafter": spec,
        "budget": budget,
        "arm": arm,
        "batch_size": batch,
        **{k: d[k] for k in keep},
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    out["steps_by_record"] = [counter.steps[k] for k in sorted(counter.steps)]  # aligned across arms by request id
    if shape is not None:
        out["shape"] = [list(s) for s in shape]
    return out


def _write(doc: dict[str, Any], out: Path) -> None:
    doc["prize"] = prize_rows(doc["cells"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(markdown(doc), encoding="utf-8")


def _machine() -> dict[str, Any]:
    from specdec.eval.results import versions

    v = versions()
    return {"cpu": v.get("cpu"), "cpu_count": v.get("cpu_count"), "platform": v.get("platform")}, v


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.out_dir) / args.out_name
    if args.decide:
        if not out.with_suffix(".json").exists():
            raise SystemExit(f"--decide: {out.with_suffix('.json')} does not exist; run the benchmark first")
        return decide(out.with_suffix(".json"), args.decide)
    if any(b < 1 for b in args.budgets):
        raise SystemExit(f"--budgets {args.budgets}: every budget must be >= 1")
    doc = _start_doc(out, argv)
    model_options = {"backend": "native", "num_threads": args.model_threads}
    slices = load_slices(
        agentic_n=args.agentic, code_n=args.code, agentic_heavy=args.agentic_heavy, code_heavy=args.code_heavy
    )
    doc["sizes"] = {
        s.name: {
            "calibration": len(s.calibration),
            "measured": len(s.measured),
            "measured_model_hybrid": len(s.measured_heavy),
        }
        for s in slices
    }
    _run_cells(args, doc, [s for s in slices if s.name in args.datasets], out=out, model_options=model_options)
    _write(doc, out)
    print(f"wrote {out.with_suffix('.json')} and .md")
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafters", nargs="+", default=["suffix", "model", "suffix+model"])
    ap.add_argument("--budgets", nargs="+", type=int, default=list(BUDGETS))
    ap.add_argument("--datasets", nargs="+", default=["openhands_swebench", "code_alpaca"])
    ap.add_argument("--static-for", nargs="*", default=["suffix"], help="drafters that get the tree-static arm")
    ap.add_argument("--agentic", type=int, default=200, help="measured agentic records (suffix)")
    ap.add_argument("--code", type=int, default=1000, help="measured code records (suffix)")
    ap.add_argument("--agentic-heavy", type=int, default=24, help="measured agentic records (model, hybrid)")
    ap.add_argument("--code-heavy", type=int, default=100, help="measured code records (model, hybrid)")
    ap.add_argument("--model-threads", type=int, default=2)
    ap.add_argument("--out-name", default="2026-11-26_cpu-2core_tree_prize")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "eval" / "results"))
    ap.add_argument(
        "--decide",
        nargs="+",
        type=int,
        metavar="B",
        help="only apply the decision rule to the saved results, with these free budgets",
    )
    return ap


def _start_doc(out: Path, argv: Sequence[str] | None) -> dict[str, Any]:
    """The results document: command, date, machine, versions, and the cells and shapes of an earlier run of the
    same ``out`` (resumed: its finished cells are kept)."""
    machine, vers = _machine()
    doc: dict[str, Any] = {
        "command": "python -m benchmarks.tree_prize " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine,
        "versions": vers,
        "method": "docs/trees.md#method",
        "cells": [],
        "shapes": {},
    }
    if out.with_suffix(".json").exists():  # resume: keep finished cells
        old = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
        doc["cells"], doc["shapes"] = old.get("cells", []), old.get("shapes", {})
        doc["earlier_commands"] = old.get("earlier_commands", []) + [old["command"]]  # the runs that made the cells
    return doc


def _run_cells(
    args: argparse.Namespace, doc: dict[str, Any], slices: Sequence[Slices], *, out: Path, model_options: dict[str, Any]
) -> None:
    """Every (drafter, dataset, budget, arm) cell not in ``doc`` yet, appended to it and written after each."""
    done = {(c["dataset"], c["drafter"], c["budget"], c["arm"]) for c in doc["cells"]}
    for spec in args.drafters:
        for sl in slices:
            for b in args.budgets:
                arms = ["chain", "tree-own"] + (["tree-static"] if spec in args.static_for else [])
                for arm in arms:
                    if (sl.name, spec, b, arm) in done:
                        continue
                    shape = None
                    if arm == "tree-static":
                        shape = _static_shape(doc, spec, sl, budget=b, model_options=model_options)
                    cell = run_cell(spec, sl, b, arm, model_options=model_options, shape=shape)
                    doc["cells"].append(cell)
                    print(f"{sl.name} {spec} B={b} {arm}: MAT {cell['mat']:.3f} ({cell['wall_s']} s)", flush=True)
                    _write(doc, out)


def _static_shape(
    doc: dict[str, Any], spec: str, sl: Slices, *, budget: int, model_options: dict[str, Any]
) -> list[RankPath]:
    """The tree-static arm's shape for (dataset, drafter, budget): calibrated once, then kept in ``doc["shapes"]``."""
    key = f"{sl.name}|{spec}|{budget}"
    if key not in doc["shapes"]:
        batch = HEAVY_BATCH if spec in HEAVY_DRAFTERS else 1
        shape_list, p = calibrate(spec, sl.calibration, budget, batch=batch, model_options=model_options)
        doc["shapes"][key] = {
            "shape": [list(s) for s in shape_list],
            "p_top": np.round(p[:8, :4], 4).tolist(),
        }
    return [tuple(s) for s in doc["shapes"][key]["shape"]]


if __name__ == "__main__":
    sys.exit(main())
