"""CPU benchmark of schedule mode's host work per step (``ScheduledDrafting`` with a simulated device wait).

vLLM's async timeline, simulated: B requests decode recorded responses (each response tiled ``--repeat`` times, so
that the suffix drafter accepts several tokens per step as on the GPU's code prompts); each step the sampled
tokens are captured, the next step's fill runs (with the device wait: its early phase, i.e. stops, starts and the
stale-front rebuilds), then ``--gpu-ms`` of the GPU's
step pass (a sleep: the engine thread's other work; no GIL held), then ``finish`` drafts and releases. Reported per
configuration, in ms per step on the engine thread: ``fill`` (with the early phase), ``finish`` (the drafting the
GPU waits for) and their sum, with the drafts' acceptance (the same for every configuration: same drafts).

    python -m benchmarks.bench_schedule_cpu --dataset code_alpaca --batch-size 64 --configs default,no_early_refresh
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from benchmarks.bench_proposer_cpu import CONTEXT_TOKENS, FakeEngine, tail_ms
from specdec.eval.loaders import load_traces
from specdec.eval.results import results_path, write_results
from specdec.vllm_plugin.core.proposer_core import ProposerCore
from specdec.vllm_plugin.entry.options import SpecdecOptions
from specdec.vllm_plugin.internal import InternalSettings
from specdec.vllm_plugin.modes.schedule import ScheduledDrafting
from specdec.vllm_plugin.modes.slots import SlotBook
from specdec.vllm_plugin.proposer import build_proposer_drafter

CONFIGS = {  # name -> proposer options and internal settings on top of schedule mode's (as SpecdecProposer sets them)
    "default": {},
    "no_early_refresh": {"early_refresh": False},
    "one_thread": {"lane_threads": 1},
    "rows_step": {"matrix_step": False},  # the drafting from Python rows, padded in Python (before matrix_step)
    "depth64": {"drafter_options": {"suffix": {"max_depth": 64}}},  # the library's trie depth (the plugin: 32)
}
WARMUP_STEPS = 5
MIN_RESPONSE = 64  # records with shorter responses are skipped
REPEAT_PREFIX = 80  # --repeat: the first tokens of each response, tiled


class HostWait:
    """The device wait, on the host: ``enqueue_copy`` queues the copy, ``release`` performs it."""

    def __init__(self) -> None:
        self.seq = 0
        self.pending: dict[int, tuple[Any, Any]] = {}

    def usable(self, dst: Any) -> bool:
        return True

    def enqueue_copy(self, dst: Any, src: Any) -> int:
        self.seq += 1
        self.pending[self.seq] = (dst, src)
        return self.seq

    def release(self, seq: int) -> None:
        dst, src = self.pending.pop(seq)
        dst.copy_(src)

    def stalls(self) -> int:
        return 0

    def fired(self) -> int:
        return 0


def capture_step(
    sched: ScheduledDrafting, eng: FakeEngine, sampled: list[list[int]], states: dict[str, Any], *, k: int
) -> Any:
    """vLLM's side of a verified step: the engine's new requests into ``states`` (their prompts), the sampled tokens
    ``[rows, k+1]`` (-1 = rejected) captured, and the next step's draft buffer ``[rows, k]`` (not filled yet)."""
    import torch

    for i, rid in enumerate(eng.ids):
        if rid not in states:
            states[rid] = SimpleNamespace(prompt_token_ids=eng.tokens[i, : eng.prompt[i]].tolist(), output_token_ids=[])
    tokens = torch.full((len(eng.ids), k + 1), -1, dtype=torch.int32)  # [rows, k+1], -1 = rejected
    for i, s in enumerate(sampled):
        tokens[i, : len(s)] = torch.tensor(s, dtype=torch.int32)
    sched.capture(tokens, list(eng.ids), set(), requests=states)
    return sched.submit(list(eng.ids), k=None, eager=False)


def run(
    config: str,
    records: list[Any],
    pool: list[Any],
    *,
    k: int,
    steps: int,
    gpu_ms: float,
    threads: int,
    adaptive: bool = True,
) -> dict[str, Any]:
    """One configuration over ``steps`` timed steps (see the module docstring); ``adaptive`` False: every decision
    that reads the clock off (the cost model; ``pad_drafts`` 'on' instead of 'auto', which pads by the measured step
    period; no drafting deadline): drafts then independent of timing, what the tests compare."""
    eng, core, book, sched = _scheduled(config, records, pool, k=k, threads=threads, adaptive=adaptive)
    try:
        fills, finishes = _timed_steps(sched, eng, book, k=k, steps=steps, gpu_ms=gpu_ms)
    finally:
        sched.close()
    stats = core.stats_dict()
    return {
        "config": config,
        "batch_size": len(records),
        "steps": steps,
        "gpu_ms": gpu_ms,
        "lane_threads": threads,
        "fill_ms": 1e3 * float(np.mean(fills)),
        "finish_ms": 1e3 * float(np.mean(finishes)),
        "engine_thread_ms": 1e3 * float(np.mean(fills) + np.mean(finishes)),
        "finish_tail": tail_ms(finishes),
        "emitted_per_step": eng.emitted / (steps + WARMUP_STEPS),
        "accepted_tokens": stats["accepted_tokens"],
        "drafted_tokens": stats["drafted_tokens"],
        "stopped": stats["stopped"],
        "fallbacks": {
            "timeouts": stats["timeouts"],
            "errors": stats["draft_errors"],
            "resyncs": stats["resyncs"],
            "watchdog": sched.feed.stats.watchdog_releases,
        },
    }


def _scheduled(
    config: str, records: list[Any], pool: list[Any], *, k: int, threads: int, adaptive: bool
) -> tuple[FakeEngine, ProposerCore, SlotBook, ScheduledDrafting]:
    """The engine stand-in over ``records`` and schedule mode's drafting for one configuration (``run``'s
    ``adaptive``), its device wait on the host."""
    timing_free = {} if adaptive else {"adaptive": False, "pad_drafts": "on", "draft_timeout_ms": 0.0}
    user, internal = InternalSettings.split(
        {
            "num_speculative_tokens": k,
            "async_drafting": True,
            "async_mode": "schedule",
            "lane_threads": threads,
            **timing_free,
            **CONFIGS[config],
        }
    )
    opts = SpecdecOptions.from_dict(user)
    max_len = CONTEXT_TOKENS + max(len(r.response_ids) for r in pool) + 8
    eng = FakeEngine(records, pool, max_len)
    drafter = build_proposer_drafter(opts)
    core = ProposerCore(drafter, opts, max_model_len=max_len, internal=internal, target_params=7e9)
    book = SlotBook(k, prefill_cap=internal.prefill_step_slots)
    sched = ScheduledDrafting(
        core,
        k=k,
        max_rows=len(records),
        device="cpu",
        device_wait=HostWait(),
        slot_book=book,
    )
    return eng, core, book, sched


def _timed_steps(
    sched: ScheduledDrafting, eng: FakeEngine, book: SlotBook, *, k: int, steps: int, gpu_ms: float
) -> tuple[list[float], list[float]]:
    """The warm-up, then ``steps`` timed steps: each step's fill and finish (seconds), the GPU's step a sleep
    between them."""
    states: dict[str, Any] = {}
    drafts: list[list[int]] = [[] for _ in eng.ids]
    fills: list[float] = []
    finishes: list[float] = []
    for step in range(steps + WARMUP_STEPS):
        out = capture_step(sched, eng, eng.verify(drafts), states, k=k)
        t0 = time.perf_counter()
        sched.fill(out)
        t1 = time.perf_counter()
        time.sleep(gpu_ms / 1e3)  # the GPU's step: the engine thread is busy elsewhere
        t2 = time.perf_counter()
        sched.finish()
        t3 = time.perf_counter()
        if step >= WARMUP_STEPS:
            fills.append(t1 - t0)
            finishes.append(t3 - t2)
        drafts = [out[i, : book.table.get(rid, k)].tolist() for i, rid in enumerate(eng.ids)]
    return fills, finishes


def main(argv: list[str] | None = None) -> None:
    ap = _parser()
    args = ap.parse_args(argv)
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    _, records = load_traces(args.dataset, limit=args.batch_size * 8)
    records = [r for r in records if len(r.response_ids) >= MIN_RESPONSE]
    if args.repeat > 1:
        records = [
            dataclasses.replace(r, response_ids=np.tile(r.response_ids[:REPEAT_PREFIX], args.repeat)) for r in records
        ]
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in args.configs}
    for i in range(args.repeats):
        for config in args.configs:
            row = run(
                config,
                records[: args.batch_size],
                records,
                k=args.k,
                steps=args.steps,
                gpu_ms=args.gpu_ms,
                threads=args.lane_threads,
            )
            runs[config].append(row)
            print(
                f"[{i + 1}/{args.repeats}] {config:16s} fill {row['fill_ms']:.3f} + finish {row['finish_ms']:.3f} "
                f"= {row['engine_thread_ms']:.3f} ms/step; emitted {row['emitted_per_step']:.1f}/step, accepted "
                f"{row['accepted_tokens']}",
                flush=True,
            )
    rows = _median_rows(runs)
    print("| config | fill ms | finish ms (GPU waits) | engine thread ms/step |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['config']} | {r['fill_ms']:.3f} | {r['finish_ms']:.3f} | {r['engine_thread_ms']:.3f} |")
    print("wrote", write_results(results_path(args.name, device="cpu"), vars(args), rows, device="cpu"))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="code_alpaca", help="trace set (specdec-eval replay names)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument(
        "--configs",
        default="default,no_early_refresh",
        type=lambda s: s.split(","),
        help=f"comma-separated, of: {', '.join(CONFIGS)}",
    )
    ap.add_argument("--k", type=int, default=16, help="num_speculative_tokens")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per run")
    ap.add_argument("--gpu-ms", type=float, default=8.0, help="the GPU's step between fill and finish (a sleep)")
    ap.add_argument(
        "--repeat",
        type=int,
        default=6,
        help="each response's first 80 tokens tiled this many times (1: the recorded responses as they are)",
    )
    ap.add_argument("--lane-threads", type=int, default=2, help="lane_threads (this machine's cores, at most)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per config (interleaved); the median is reported")
    ap.add_argument("--name", default="bench_schedule_cpu", help="results file name part")
    return ap


def _median_rows(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per configuration, its median run by engine-thread ms per step, with every run's value beside it."""
    rows = []
    for rs in runs.values():
        row = sorted(rs, key=lambda r: r["engine_thread_ms"])[len(rs) // 2]
        row["all_engine_thread_ms"] = [r["engine_thread_ms"] for r in rs]
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
