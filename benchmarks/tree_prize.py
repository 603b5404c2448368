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
import heapq
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specdec.drafters.base import Drafter, DraftRequest
from specdec.eval.records import TraceRecord
from specdec.tree import ROOT, TokenTree

RankPath = tuple[int, ...]  # ranks among siblings (0 = most probable) from the top level down to a node
MAX_DEPTH = 64  # deepest level of the acceptance table
MAX_RANK = 8  # ranks per level in the acceptance table
MAX_POOL = 256  # pool budget cap
POOL_FACTOR = 4  # pool budget = min(POOL_FACTOR * B, MAX_POOL)
BUDGETS = (1, 2, 4, 8, 16, 32, 64)
PRIZE_THRESHOLD = 1.08  # tree / chain MAT at a free budget that counts as a prize
AGENTIC_CAL_INSTANCES = 5  # OpenHands instances (groups) in the calibration slice
CODE_CAL_RECORDS = 300  # code_alpaca records in the calibration slice
HEAVY_DRAFTERS = ("model", "suffix+model")  # draft-model drafters: smaller measured slices, batched replay
HEAVY_BATCH = 16  # requests replayed at once for HEAVY_DRAFTERS
BOOTSTRAP_DRAWS = 2000  # resamples of the records for the tree / chain interval


# ----------------------------------------------------------------------------- static shapes (pure logic)
def rank_paths(tree: TokenTree) -> list[RankPath]:
    """[n] the rank path of every node: siblings ranked by ``probs`` descending, ties (or no probs) by index."""
    n = len(tree)
    probs = tree.probs.tolist() if tree.probs is not None else [0.0] * n
    parents = tree.parents.tolist()
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    rank = [0] * n
    for group in kids.values():
        for r, i in enumerate(sorted(group, key=lambda j: (-probs[j], j))):
            rank[i] = r
    out: list[RankPath] = []
    for i, p in enumerate(parents):  # parents come first: their paths are known
        out.append((out[p] if p != ROOT else ()) + (rank[i],))
    return out


@dataclass
class RankStats:
    """Counts for the acceptance table: ``hits[d-1][r]`` steps whose true token at depth d was the rank-r child of
    the accepted depth-(d-1) node, out of ``reach[d-1]`` steps that accepted d - 1 tokens and knew the next one."""

    hits: np.ndarray = field(default_factory=lambda: np.zeros((MAX_DEPTH, MAX_RANK), np.int64))  # [D, R]
    reach: np.ndarray = field(default_factory=lambda: np.zeros(MAX_DEPTH, np.int64))  # [D]

    def observe(self, tree: TokenTree, truth: Sequence[int]) -> None:
        """Walk ``tree`` along ``truth`` (the true tokens known after the step: accepted + next) and count."""
        paths = rank_paths(tree) if len(tree) else []
        cur = ROOT
        for d, tok in enumerate(truth[:MAX_DEPTH]):
            self.reach[d] += 1
            nxt = next((c for c in tree.children(cur) if int(tree.tokens[c]) == int(tok)), None) if len(tree) else None
            if nxt is None:
                return
            r = paths[nxt][-1]
            if r < MAX_RANK:
                self.hits[d, r] += 1
            cur = nxt


def acceptance_table(stats: RankStats) -> np.ndarray:
    """[D, R] p[d-1][r] = hits / reach (0 where never reached), made non-increasing in r (running minimum)."""
    p = stats.hits / np.maximum(stats.reach, 1)[:, None]
    return np.minimum.accumulate(p, axis=1)


def static_shape(p: np.ndarray, budget: int) -> list[RankPath]:
    """The ``budget`` rank paths of highest value prod_i p[i][r_i] (ties: shallower, then lower ranks), best first.

    Grown best-first from the root: a path enters the frontier only after its parent (as first child) or its
    elder sibling, so the result is closed under both and, with ``p`` non-increasing in rank (and every value
    <= 1), holds the top ``budget`` values. Paths of value 0 are left out.
    """
    depth_max, rank_max = p.shape
    heap: list[tuple[float, int, RankPath, float]] = []  # (-value, depth, path, parent value)

    def push(path: RankPath, parent_value: float) -> None:
        d, r = len(path), path[-1]
        if d <= depth_max and r < rank_max:
            value = parent_value * float(p[d - 1, r])
            if value > 0.0:
                heapq.heappush(heap, (-value, d, path, parent_value))

    push((0,), 1.0)
    out: list[RankPath] = []
    while heap and len(out) < budget:
        neg, _d, path, parent_value = heapq.heappop(heap)
        out.append(path)
        push(path + (0,), -neg)
        push(path[:-1] + (path[-1] + 1,), parent_value)
    return out


def prune_to_shape(tree: TokenTree, shape: frozenset[RankPath]) -> TokenTree:
    """The nodes of ``tree`` whose rank path is in ``shape`` (closed under parents), in the tree's order."""
    if not len(tree):
        return tree
    keep = [i for i, rp in enumerate(rank_paths(tree)) if rp in shape]
    remap = {old: new for new, old in enumerate(keep)}
    parents = [ROOT if int(tree.parents[i]) == ROOT else remap[int(tree.parents[i])] for i in keep]
    probs = tree.probs[keep] if tree.probs is not None else None
    return TokenTree(tree.tokens[keep], np.asarray(parents, np.int32), probs)


def pool_budget(budget: int) -> int:
    return min(POOL_FACTOR * budget, MAX_POOL)


# ----------------------------------------------------------------------------- drafter wrappers for replay
class _Wrapper(Drafter):
    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.name = inner.name

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self.inner.start(request_id, prompt_ids)

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.inner.extend(request_id, token_ids)

    def stop(self, request_id: str) -> None:
        self.inner.stop(request_id)

    def close(self) -> None:
        self.inner.close()


class RecordingDrafter(_Wrapper):
    """Drafts the inner drafter's trees unchanged and feeds each step's outcome to ``stats`` (calibration)."""

    def __init__(self, inner: Drafter, stats: RankStats) -> None:
        super().__init__(inner)
        self.stats = stats
        self._pending: dict[str, TokenTree] = {}

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        trees = self.inner.draft_batch(requests)
        for r, t in zip(requests, trees):
            self._pending[r.request_id] = t
        return trees

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        tree = self._pending.pop(request_id, None)
        if tree is not None:  # emitted = accepted path + the true next token: all the walk needs
            self.stats.observe(tree, list(token_ids))
        super().extend(request_id, token_ids)


class ShapedDrafter(_Wrapper):
    """Tree requests: the inner drafter's tree at the pool budget pruned to ``shape``; chains pass through."""

    def __init__(self, inner: Drafter, shape: Sequence[RankPath]) -> None:
        super().__init__(inner)
        self.shape = frozenset(shape)

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        asks = [DraftRequest(r.request_id, pool_budget(r.budget), True, r.free) if r.tree else r for r in requests]
        trees = self.inner.draft_batch(asks)
        return [prune_to_shape(t, self.shape) if r.tree else t for r, t in zip(requests, trees)]


class StepCounter(_Wrapper):
    """Counts the steps (draft calls) of every request, for the paired bootstrap over records."""

    def __init__(self, inner: Drafter) -> None:
        super().__init__(inner)
        self.steps: dict[str, int] = {}

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        for r in requests:
            self.steps[r.request_id] = self.steps.get(r.request_id, 0) + 1
        return self.inner.draft_batch(requests)


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


# ----------------------------------------------------------------------------- report
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
    args = ap.parse_args(argv)
    out = Path(args.out_dir) / args.out_name
    if args.decide:
        if not out.with_suffix(".json").exists():
            raise SystemExit(f"--decide: {out.with_suffix('.json')} does not exist; run the benchmark first")
        return decide(out.with_suffix(".json"), args.decide)
    if any(b < 1 for b in args.budgets):
        raise SystemExit(f"--budgets {args.budgets}: every budget must be >= 1")
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
    done = {(c["dataset"], c["drafter"], c["budget"], c["arm"]) for c in doc["cells"]}
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
    for spec in args.drafters:
        for sl in (s for s in slices if s.name in args.datasets):
            for b in args.budgets:
                arms = ["chain", "tree-own"] + (["tree-static"] if spec in args.static_for else [])
                for arm in arms:
                    if (sl.name, spec, b, arm) in done:
                        continue
                    shape = None
                    if arm == "tree-static":
                        key = f"{sl.name}|{spec}|{b}"
                        if key not in doc["shapes"]:
                            batch = HEAVY_BATCH if spec in HEAVY_DRAFTERS else 1
                            shape_list, p = calibrate(spec, sl.calibration, b, batch=batch, model_options=model_options)
                            doc["shapes"][key] = {
                                "shape": [list(s) for s in shape_list],
                                "p_top": np.round(p[:8, :4], 4).tolist(),
                            }
                        shape = [tuple(s) for s in doc["shapes"][key]["shape"]]
                    cell = run_cell(spec, sl, b, arm, model_options=model_options, shape=shape)
                    doc["cells"].append(cell)
                    print(f"{sl.name} {spec} B={b} {arm}: MAT {cell['mat']:.3f} ({cell['wall_s']} s)", flush=True)
                    _write(doc, out)
    _write(doc, out)
    print(f"wrote {out.with_suffix('.json')} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
