"""CPU benchmark of the vLLM proposer's engine-thread cost per step, by mode.

A fake vLLM loop over recorded traces: B requests decode their recorded responses; each step verifies the
previous drafts greedily against the recorded continuation (accepted prefix + the next token), hands vLLM-shaped
arrays to the proposer, and then spends ``--engine-work-ms`` of Python on the engine thread (vLLM's
``update_from_output`` between ``propose`` and ``take_draft_token_ids``, ~0.5-2 ms at batch 64). Reported per
mode: engine-thread milliseconds per step spent in the proposer (``sync``: the whole ``ProposerCore.step`` with
the native one-call step; ``sync-python``: its Python path; ``thread``: submit + the wait in collect), emitted
tokens (identical across modes: same drafts).

    python -m benchmarks.bench_proposer_cpu --dataset code_alpaca --batch-sizes 8,64 --engine-work-ms 1.0
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from specdec.drafters.registry import build_drafter
from specdec.eval.loaders import load_traces
from specdec.eval.results import results_path, write_results
from specdec.vllm_plugin.core.batch import StepBatch
from specdec.vllm_plugin.core.proposer_core import ProposerCore
from specdec.vllm_plugin.entry.options import SpecdecOptions
from specdec.vllm_plugin.internal import InternalSettings
from specdec.vllm_plugin.modes.thread import ThreadedProposerCore

CONTEXT_TOKENS = 1500  # prompt tail kept per request (the GPU benchmark's agentic prompts are 1.5k tokens)
WARMUP_STEPS = 2  # untimed first steps (requests start: their prompts are indexed)
MIN_RESPONSE = 64  # records with shorter responses are skipped


class FakeEngine:
    """B rows replaying recorded responses with vLLM's array layout (see the module docstring). A row whose
    response is done gets the next record as a new request (its prompt prefilled, its first token sampled), as
    in continuous batching: the proposer stops the old request and starts the new one."""

    def __init__(self, records: list[Any], pool: list[Any], max_model_len: int) -> None:
        b = len(records)
        self.pool, self.next_record = pool, b
        self.tokens = np.zeros((b, max_model_len), np.int32)  # [B, max_model_len] like token_ids_cpu
        self.n = np.zeros(b, np.int32)  # [B] num_tokens_no_spec
        self.prompt = np.zeros(b, np.int32)  # [B] num_prompt_tokens
        self.responses: list[list[int]] = [[] for _ in range(b)]
        self.pos = [0] * b
        self.ids = [""] * b
        self.emitted = self.started = 0
        for i, r in enumerate(records):
            self._load(i, r)

    def _load(self, i: int, record: Any) -> None:
        p = record.prompt_ids[-CONTEXT_TOKENS:]
        self.tokens[i, : len(p)] = p
        self.n[i] = self.prompt[i] = len(p)
        self.responses[i], self.pos[i] = record.response_ids.tolist(), 0
        self.ids[i] = f"req-{self.started}"
        self.started += 1

    def verify(self, drafts: list[list[int]]) -> list[list[int]]:
        """Greedy verification against the recorded continuation; appends accepted + next token."""
        sampled = []
        for i in range(len(self.ids)):
            draft = drafts[i] if drafts else []
            if self.pos[i] >= len(self.responses[i]):  # done: the row's next request, its first token sampled
                self._load(i, self.pool[self.next_record % len(self.pool)])
                self.next_record += 1
                draft = []  # the old request's draft does not apply
            resp, out = self.responses[i], []
            for d in draft + [None]:
                if self.pos[i] >= len(resp):
                    break
                want = resp[self.pos[i]]
                out.append(want)
                self.pos[i] += 1
                if d != want:
                    break
            self.tokens[i, self.n[i] : self.n[i] + len(out)] = out
            self.n[i] += len(out)
            self.emitted += len(out)
            sampled.append(out)
        return sampled


def _busy(ms: float) -> None:
    """Python work on this thread (holds the GIL like vLLM's scheduler does)."""
    end, x = time.perf_counter() + ms / 1e3, 0
    while time.perf_counter() < end:
        x += 1


MODES = {  # name -> proposer options and internal settings
    "sync": {},
    "sync-python": {"native_step": False},
    "sync-2t": {"lane_threads": 2},  # the native step's rows drafted by the engine thread and one helper
    "sync-4t": {"lane_threads": 4},
    "thread": {"async_drafting": True, "async_mode": "thread"},
}
DEFERRED = ("thread",)  # modes whose drafts are collected after the engine work


def tail_ms(times: list[float]) -> dict[str, float]:
    """Median, 99th percentile and worst step (ms) of per-step engine-thread times (seconds)."""
    if not times:
        return {"p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
    ms = np.sort(np.asarray(times)) * 1e3
    return {"p50_ms": float(np.median(ms)), "p99_ms": float(np.percentile(ms, 99)), "max_ms": float(ms[-1])}


def run(
    mode: str,
    records: list[Any],
    pool: list[Any],
    *,
    k: int,
    steps: int,
    engine_work_ms: float,
    suffix_depth: int | None = None,
) -> dict[str, Any]:
    user, internal = InternalSettings.split(
        {"num_speculative_tokens": k, "draft_timeout_ms": 0, "pad_drafts": "on", "adaptive": False, **MODES[mode]}
    )
    opts = SpecdecOptions.from_dict(user)
    max_len = CONTEXT_TOKENS + max(len(r.response_ids) for r in pool) + 8
    eng = FakeEngine(records, pool, max_len)
    suffix_opts = {} if suffix_depth is None else {"max_depth": suffix_depth}
    if suffix_opts:
        opts = opts.replace(drafter_options={"suffix": suffix_opts})
    core_cls = ThreadedProposerCore if mode == "thread" else ProposerCore
    drafter = build_drafter("suffix", {"suffix": suffix_opts})
    proposer: Any = core_cls(drafter, opts, max_model_len=max_len, internal=internal)
    spent, drafts = 0.0, [[] for _ in records]
    per_step: list[float] = []
    step_fn: Callable[..., Any] = proposer.submit if mode in DEFERRED else proposer.step
    gc.collect()
    gc.freeze()  # as vLLM's engine core does after start-up: the long-lived heap leaves the collector's scans
    try:
        for step in range(steps + WARMUP_STEPS):
            sampled = eng.verify(drafts)
            t0 = time.perf_counter()
            out = step_fn(StepBatch(eng.ids, sampled, eng.n, eng.tokens, num_prompt_tokens=eng.prompt))
            t = time.perf_counter() - t0
            _busy(engine_work_ms)
            if mode in DEFERRED:
                t1 = time.perf_counter()
                out = proposer.collect()
                t += time.perf_counter() - t1
            drafts = out
            if step >= WARMUP_STEPS:
                spent += t
                per_step.append(t)
    finally:
        proposer.close()
    return {
        "mode": mode,
        "batch_size": len(records),
        "steps": steps,
        "engine_work_ms": engine_work_ms,
        "suffix_depth": suffix_depth,
        "proposer_ms_per_step": 1e3 * spent / steps,
        "emitted_tokens": eng.emitted,
        **tail_ms(per_step),
        "requests_started": eng.started,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="code_alpaca", help="trace set (specdec-eval replay names)")
    ap.add_argument("--batch-sizes", default="8,64", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument(
        "--modes",
        default="sync,sync-python,thread",
        type=lambda s: s.split(","),
        help="sync: in-process, native one-call step; "
        "sync-python: the Python path; thread: the native step on "
        "its own thread (async_mode='thread')",
    )
    ap.add_argument("--k", type=int, default=16, help="num_speculative_tokens (drafts padded to k)")
    ap.add_argument("--steps", type=int, default=60, help="timed steps per run")
    ap.add_argument("--engine-work-ms", type=float, default=1.0, help="engine-thread work between propose and take")
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode (interleaved); the median is reported")
    ap.add_argument("--suffix-depth", type=int, default=None, help="suffix drafter max_depth (default: its own)")
    ap.add_argument("--name", default="bench_proposer_cpu", help="results file name part")
    args = ap.parse_args(argv)
    _, all_records = load_traces(args.dataset, limit=max(args.batch_sizes) * 8)
    all_records = [r for r in all_records if len(r.response_ids) >= MIN_RESPONSE]
    rows = []
    for b in args.batch_sizes:
        records = all_records[:b]
        for mode in args.modes:
            runs = [
                run(
                    mode,
                    records,
                    all_records,
                    k=args.k,
                    steps=args.steps,
                    engine_work_ms=args.engine_work_ms,
                    suffix_depth=args.suffix_depth,
                )
                for _ in range(args.repeats)
            ]
            row = sorted(runs, key=lambda r: r["proposer_ms_per_step"])[len(runs) // 2]
            row["all_ms_per_step"] = [r["proposer_ms_per_step"] for r in runs]
            rows.append(row)
            print(
                f"B={b:3d} {mode:8s} proposer on the engine thread: {row['proposer_ms_per_step']:.3f} ms/step "
                f"(runs {', '.join(f'{x:.3f}' for x in row['all_ms_per_step'])}), p50 {row['p50_ms']:.3f} "
                f"p99 {row['p99_ms']:.2f} max {row['max_ms']:.1f} ms, emitted {row['emitted_tokens']}",
                flush=True,
            )
    print("wrote", write_results(results_path(args.name, device="cpu"), vars(args), rows, device="cpu"))


if __name__ == "__main__":
    main()
