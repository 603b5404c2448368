"""CPU replay of schedule mode's draft slots: what the one-round slot lag costs, and what ``slot_growth`` wins back.

Under vLLM's async scheduling a request's draft slots for step N+1 are granted before step N's tokens exist, from
the length of its latest draft (``slots.SlotBook``). Here B rows decode recorded responses (best: the target's own
greedy outputs, ``benchmarks/target_outputs.py``) through the plugin's real ``ScheduledDrafting`` and ``SlotBook``, in
vLLM's order: schedule (the book grants each row its slots), execute (the drafting of the step, from the previous
step's tokens; the book notes the drafts and settles the grants of the step whose tokens arrived), verify (each
row's draft cut to its slots, greedy against the recording). ``sync`` gives every draft its own length (the
synchronous path's bound: no forecast needed). Reported per configuration: emitted and verified tokens per step,
the growth's extra slots and the share of them that held an accepted token (over the run), and tokens per ms under a
linear step model (``--step-ms`` + ``--token-us`` per verified token; defaults from a step-cost fit at batch 64,
8B-sized target on an H200: a model, not a measurement). ``--cut`` replays with the proposer's adaptive control on and
the confidence cut at the forced ``--token-cost`` (the GPU's fit at batch 64 on code prompts was about 0.36), as on the
GPU; the rows then also report the tokens the slots cut off fresh drafts (``truncated``) and the slots past a fresh
draft (``filler``, verified though the draft ended), per step.

    python -m benchmarks.bench_slot_forecast /tmp/code.jsonl /tmp/agentic.jsonl --growth sync,0,1,2
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.bench_proposer_cpu import CONTEXT_TOKENS, FakeEngine
from benchmarks.bench_schedule_cpu import HostWait, capture_step
from specdec.eval.loaders import load_traces
from specdec.eval.results import results_path, write_results
from specdec.vllm_plugin.core.adaptive import StepCostModel
from specdec.vllm_plugin.core.proposer_core import ProposerCore
from specdec.vllm_plugin.entry.options import SpecdecOptions
from specdec.vllm_plugin.modes.schedule import ScheduledDrafting
from specdec.vllm_plugin.modes.slots import SlotBook
from specdec.vllm_plugin.proposer import build_proposer_drafter

MIN_RESPONSE = 32  # records with shorter responses are skipped
SYNC = "sync"  # --growth entry: every draft verified at its own length


class ForcedCost(StepCostModel):
    """A step-cost model whose token cost is fixed (the GPU's fit, forced): the confidence cut of ``--cut``."""

    def __init__(self, token_cost: float) -> None:
        super().__init__()
        self.forced = token_cost

    def token_cost(self) -> float:
        return self.forced


def run(
    records: list[Any], *, batch_size: int, growth: str, k: int, steps: int, token_cost: float, cut: bool = False
) -> dict[str, Any]:
    """One configuration (``growth``: a ``slot_growth`` value, or ``SYNC``) over ``steps`` steps; ``cut``: drafts
    cut where the calibrated acceptance probability falls below ``token_cost`` (adaptive control on)."""
    opts = SpecdecOptions.from_dict(
        {
            "num_speculative_tokens": k,
            "async_drafting": True,
            "async_mode": "schedule",
            "lane_threads": 1,
            "adaptive": cut,
        }
    )
    max_len = CONTEXT_TOKENS + max(len(r.response_ids) for r in records) + 8
    eng = FakeEngine(records[:batch_size], records, max_len)
    core = ProposerCore(build_proposer_drafter(opts), opts, max_model_len=max_len, target_params=7e9)
    core.policy.token_cost = lambda running: token_cost  # type: ignore[method-assign]  # the GPU's fit, forced
    if cut:
        forced = ForcedCost(token_cost)
        core.policy.cost_model = lambda running: forced  # type: ignore[method-assign]  # every bucket's cut
    book = SlotBook(k, prefill_cap=-1, growth=0.0 if growth == SYNC else float(growth))
    rows = len(eng.ids)
    sched = ScheduledDrafting(core, k=k, max_rows=rows, device="cpu", device_wait=HostWait(), slot_book=book)
    states: dict[str, Any] = {}
    drafts: list[list[int]] = [[] for _ in range(rows)]
    verified = truncated = filler = 0
    try:
        for _ in range(steps):
            # step N verified (each row's draft cut to its slots); the buffer [rows, k] of step N+1's drafts
            out = capture_step(sched, eng, eng.verify(drafts), states, k=k)
            sched.fill(out)
            book.begin_schedule()  # schedule N+1: slots from the drafts verified in step N
            slots = [book.slots(rid, k) for rid in eng.ids]
            sched.finish()  # step N+1's drafting, from step N's tokens
            fresh = [book.lengths.get(rid, k) for rid in eng.ids]  # [rows] step N+1's drafts, uncut by slots
            if growth == SYNC:
                slots = fresh
            truncated += sum(max(f - n, 0) for f, n in zip(fresh, slots))
            filler += sum(max(n - f, 0) for f, n in zip(fresh, slots))
            drafts = [out[i, :n].tolist() for i, n in enumerate(slots)]
            verified += sum(map(len, drafts)) + rows
    finally:
        sched.close()
    return {
        "growth": growth,
        "batch_size": rows,
        "steps": steps,
        "token_cost": token_cost,
        "cut": cut,
        "emitted_per_step": eng.emitted / steps,
        "verified_per_step": verified / steps,
        "truncated_per_step": truncated / steps,
        "filler_per_step": filler / steps,
        **book.as_dict(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", help="trace sets (files or specdec-eval dataset names)")
    ap.add_argument(
        "--growth",
        default="sync,0,1",
        type=lambda s: s.split(","),
        help="comma-separated slot_growth values, and 'sync' (drafts at their own length)",
    )
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--k", type=int, default=16, help="num_speculative_tokens")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument(
        "--token-cost",
        type=float,
        default=0.0,
        help="the acceptance probability a verified token needs (the GPU's cost fit, forced)",
    )
    ap.add_argument(
        "--cut",
        action="store_true",
        help="adaptive control on: drafts cut at --token-cost, as the proposer does on the GPU",
    )
    ap.add_argument("--step-ms", type=float, default=6.4, help="step model: fixed ms per step")
    ap.add_argument("--token-us", type=float, default=18.8, help="step model: us per verified token")
    ap.add_argument("--name", default="bench_slot_forecast", help="results file name part")
    args = ap.parse_args(argv)
    bad = [g for g in args.growth if g != SYNC and not _is_float(g)]
    if bad:
        ap.error(f"--growth: {', '.join(bad)} is neither a number nor '{SYNC}'")
    rows = []
    print(
        "| traces | growth | emitted/step | verified/step | truncated/step | filler/step | extra slots used | "
        "est tokens/ms |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    for source in args.traces:
        name, records = load_traces(source)
        records = [r for r in records if len(r.response_ids) >= MIN_RESPONSE]
        for g in args.growth:
            row = run(
                records,
                batch_size=args.batch_size,
                growth=g,
                k=args.k,
                steps=args.steps,
                token_cost=args.token_cost,
                cut=args.cut,
            )
            row["traces"] = name
            row["est_tokens_per_ms"] = row["emitted_per_step"] / (
                args.step_ms + 1e-3 * args.token_us * row["verified_per_step"]
            )
            rows.append(row)
            paid = row["growth_extra_used"] / row["growth_extra_slots"] if row["growth_extra_slots"] else None
            row["growth_used_share"] = paid
            print(
                f"| {name} | {g} | {row['emitted_per_step']:.1f} | {row['verified_per_step']:.1f} | "
                f"{row['truncated_per_step']:.1f} | {row['filler_per_step']:.1f} | "
                f"{'-' if paid is None else f'{paid:.2f}'} | {row['est_tokens_per_ms']:.2f} |",
                flush=True,
            )
    print("wrote", write_results(results_path(args.name, device="cpu"), vars(args), rows, device="cpu"))


def _is_float(s: str) -> bool:
    try:
        return float(s) >= 0
    except ValueError:
        return False


if __name__ == "__main__":
    main()
