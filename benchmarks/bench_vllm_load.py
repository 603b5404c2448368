"""The vLLM benchmark's two load modes (``bench_vllm --load``), each measuring one cell on one engine.

* ``closed``: batch size b = exactly b prompts submitted together (``LLM.generate`` over chunks of b). With
  speculative decoding requests finish at different times, so each chunk ends with a tail of stragglers.
* ``sustained``: ``SUSTAINED_FACTOR`` x b prompts (``prepare_prompts``' ``sus{b}`` sets) through the engine with at
  most b in flight: the first b added, then one new request each time one finishes (continuous batching, as a
  server keeps its batch full), until all are done.

Both return the same cell fields (tokens/s over the wall time, MAT, acceptance, engine steps, drafting time, GPU
idle gap and busy time per step, the outputs in prompt order for the bf16 mismatch count), with ``load`` naming
the mode; a sustained cell adds ``concurrency``.

Output lengths (``bench_vllm --output-lengths``): every request asks for the same ``max_tokens`` (``fixed``), or,
in sustained cells, prompt i asks for ``varied_lengths(N)[i]`` (``varied``: uniform over ``VARIED_LENGTHS``, drawn
from one seed, so every method gets the same length per prompt). With one fixed length no-spec runs in lockstep
under sustained load (all b requests finish in the same step, b successors prefill together), unlike a server.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks.step_timer import CellTimer
from benchmarks.step_trace import PHASE_COLS, SPLIT_COLS, host_late_share

SUSTAINED_REQUEST_PREFIX = "sus"  # request ids "<prefix>-<prompt index>" (LLM.generate's ids are bare numbers)
MS_PER_S = 1e3
FIXED, VARIED = "fixed", "varied"
OUTPUT_LENGTHS = (FIXED, VARIED)  # bench_vllm --output-lengths (varied: sustained cells only)
VARIED_LENGTHS = (128, 384)  # varied: max_tokens uniform over [lo, hi] (inclusive): mean 256, the fixed length
VARIED_LENGTH_SEED = 0  # one draw per cell from this seed: the same length per prompt for every method
# diagnostic (a variant's "env"): a sustained cell starts with one request alone for one engine step, the others
# after it, as an engine core in its own process can start before the first b requests have all arrived
LEAD_REQUEST_ENV = "SPECDEC_BENCH_LEAD_REQUEST"


def varied_lengths(n: int) -> list[int]:
    """Per-request ``max_tokens`` of a varied-length cell of ``n`` prompts: ``n`` integers uniform over
    ``VARIED_LENGTHS`` (inclusive), drawn from ``VARIED_LENGTH_SEED`` (the same list on every call)."""
    lo, hi = VARIED_LENGTHS
    return [int(x) for x in np.random.default_rng(VARIED_LENGTH_SEED).integers(lo, hi + 1, size=n)]


def with_max_tokens(params: Any, max_tokens: int) -> Any:
    """A copy of ``params`` (vLLM's ``SamplingParams.clone``, else ``copy.copy``) asking for ``max_tokens``;
    ``params`` itself is left as it is."""
    out = params.clone() if hasattr(params, "clone") else copy.copy(params)
    out.max_tokens = max_tokens
    return out


def spec_counters(llm: Any) -> dict[str, float]:
    """vLLM's speculative-decoding counters (accepted and drafted tokens so far), {} if it reports none."""
    out: dict[str, float] = {}
    try:
        for m in llm.get_metrics():
            if "spec_decode_num" in m.name and hasattr(m, "value"):
                key = m.name.split("spec_decode_num_")[-1].replace("_total", "")
                out[key] = out.get(key, 0.0) + float(m.value)
    except Exception:  # noqa: BLE001 - metrics are optional
        pass
    return out


def tpot_ms(outputs: list[Any]) -> float | None:
    """Mean time per output token after the first (ms) over requests whose metrics carry both timestamps."""
    vals = []
    for o in outputs:
        m = getattr(o, "metrics", None)
        first, last = getattr(m, "first_token_ts", None), getattr(m, "last_token_ts", None)
        n = len(o.outputs[0].token_ids)
        if first and last and n > 1 and last > first:
            vals.append((last - first) / (n - 1) * MS_PER_S)
    return sum(vals) / len(vals) if vals else None


def feed(
    engine: Any,
    prompts: list[list[int]],
    concurrency: int,
    params: Any,
    *,
    request_prefix: str = SUSTAINED_REQUEST_PREFIX,
    max_tokens: Sequence[int] | None = None,
) -> tuple[list[Any], float]:
    """Run ``prompts`` through ``engine`` (vLLM's ``LLMEngine``: ``add_request``, ``step``,
    ``has_unfinished_requests``) with at most ``concurrency`` requests in flight, a new one added as soon as a step
    reports one finished. Returns the finished outputs in prompt order and the seconds from the first add to the
    step that finished the last request. Request ids: ``<request_prefix>-<prompt index>``. ``max_tokens`` (one per
    prompt): request i gets a copy of ``params`` asking for ``max_tokens[i]`` (made before the clock starts);
    without it every request gets ``params``."""
    if max_tokens is not None and len(max_tokens) != len(prompts):
        raise ValueError(f"max_tokens: {len(max_tokens)} lengths for {len(prompts)} prompts")
    per_request = [params] * len(prompts) if max_tokens is None else [with_max_tokens(params, n) for n in max_tokens]
    outputs: list[Any] = [None] * len(prompts)
    index: dict[str, int] = {}

    def add() -> None:
        i = len(index)
        index[f"{request_prefix}-{i}"] = i
        engine.add_request(f"{request_prefix}-{i}", {"prompt_token_ids": prompts[i]}, per_request[i])

    t0 = time.perf_counter()
    if os.environ.get(LEAD_REQUEST_ENV) == "1" and prompts:
        add()
        for out in engine.step():
            if out.finished:
                outputs[index[out.request_id]] = out
    while len(index) < min(concurrency, len(prompts)):
        add()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[index[out.request_id]] = out
                if len(index) < len(prompts):
                    add()
    wall = time.perf_counter() - t0
    missing = [i for i, o in enumerate(outputs) if o is None]
    if missing:
        raise RuntimeError(
            f"sustained load: {len(missing)} of {len(prompts)} requests never finished (first: prompt {missing[0]})"
        )
    return outputs, wall


def run_closed(llm: Any, prompts: list[list[int]], batch: int, sp: Any, timer: CellTimer) -> dict[str, Any]:
    """A closed-batch cell: ``LLM.generate`` over chunks of ``batch`` prompts (wall = the sum of the calls)."""

    def measure() -> tuple[list[list[int]], float, list[float]]:
        wall, outs, tpots = 0.0, [], []
        for i in range(0, len(prompts), batch):
            chunk = [{"prompt_token_ids": p} for p in prompts[i : i + batch]]
            timer.gpu_on = True
            t0 = time.perf_counter()
            res = llm.generate(chunk, sp, use_tqdm=False)
            wall += time.perf_counter() - t0
            timer.gpu_on = False
            timer.collect_gpu()
            outs += [list(r.outputs[0].token_ids) for r in res]
            t = tpot_ms(res)
            if t is not None:
                tpots.append(t)
        return outs, wall, tpots

    return {**measured_cell(llm, timer, batch, measure), "load": "closed"}


def run_sustained(
    llm: Any,
    prompts: list[list[int]],
    concurrency: int,
    sp: Any,
    timer: CellTimer,
    *,
    request_prefix: str = SUSTAINED_REQUEST_PREFIX,
    max_tokens: Sequence[int] | None = None,
) -> dict[str, Any]:
    """A sustained-load cell: ``feed`` on the LLM's engine (``sp`` should ask for final outputs only, as
    ``LLM.generate`` does, so steps do not build a partial output per request; ``request_prefix`` unique per cell
    of an engine; ``max_tokens``: per-prompt lengths, as ``feed``'s)."""

    def measure() -> tuple[list[list[int]], float, list[float]]:
        timer.gpu_on = True
        res, wall = feed(llm.llm_engine, prompts, concurrency, sp, request_prefix=request_prefix, max_tokens=max_tokens)
        timer.gpu_on = False
        timer.collect_gpu()
        t = tpot_ms(res)
        return [list(r.outputs[0].token_ids) for r in res], wall, [] if t is None else [t]

    return {**measured_cell(llm, timer, concurrency, measure), "load": "sustained", "concurrency": concurrency}


def measured_cell(
    llm: Any, timer: CellTimer, batch: int, measure: Callable[[], tuple[list[list[int]], float, list[float]]]
) -> dict[str, Any]:
    """Run ``measure`` (-> outputs in prompt order, wall seconds, TPOTs in ms) and book the cell: tokens/s, MAT and
    acceptance from vLLM's counters, engine steps, drafting and GPU gap/busy from ``timer`` (deltas over the run)."""
    c0, t0 = spec_counters(llm), timer.counts()
    outs, wall, tpots = measure()
    c1, t1 = spec_counters(llm), timer.counts()
    n_out = sum(map(len, outs))
    accepted = c1.get("accepted_tokens", 0.0) - c0.get("accepted_tokens", 0.0)
    drafted = c1.get("draft_tokens", 0.0) - c0.get("draft_tokens", 0.0)
    steps, draft_s = t1["steps"] - t0["steps"], t1["draft_s"] - t0["draft_s"]
    gaps = t1["gap_n"] - t0["gap_n"]
    trace = timer.take_trace()
    return {
        "gpu_gap_ms_per_step": (t1["gap_ms"] - t0["gap_ms"]) / gaps if gaps else None,
        "gpu_busy_ms_per_step": (t1["busy_ms"] - t0["busy_ms"]) / gaps if gaps else None,
        "batch_size": batch,
        "prompts": len(outs),
        "output_tokens": n_out,
        "wall_s": wall,
        "tokens_per_s": n_out / wall,
        "tpot_ms": sum(tpots) / len(tpots) if tpots else MS_PER_S * wall * batch / max(n_out, 1),
        "mat": n_out / max(n_out - accepted, 1),
        "accepted_tokens": accepted,
        "drafted_tokens": drafted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "engine_steps": steps,
        "draft_ms_per_step": MS_PER_S * draft_s / steps if steps else None,
        "draft_share": draft_s / wall if steps else None,
        "outputs": outs,
        **(_with_split(trace) if trace is not None else {}),
    }


def _with_split(trace: dict[str, list[Any]]) -> dict[str, Any]:
    """The cell's trace, the means of its gap split (schedule mode's device wait; ``step_trace.SPLIT_COLS``) over
    the steps that have one, and of the host's phases per step period (``step_trace.PHASE_COLS``) over the steps
    with a measured period."""
    out: dict[str, Any] = {"trace": trace}
    split = {}
    for col in SPLIT_COLS:
        vals = [v for v in trace.get(col, ()) if v is not None]
        if vals:
            split[col] = sum(vals) / len(vals)
            split[f"{col}_steps"] = len(vals)
    if split:
        split["host_late_share"] = host_late_share(trace)
        out["gap_split_ms"] = split
    timed = [i for i, p in enumerate(trace.get("period_ms", ())) if p is not None]
    phases = [col for col in PHASE_COLS if any(v is not None for v in trace.get(col, ()))]  # columns timed at all
    if timed and phases:
        out["host_phase_ms"] = {
            "period_ms": sum(trace["period_ms"][i] for i in timed) / len(timed),
            **{col: sum(trace[col][i] or 0.0 for i in timed) / len(timed) for col in phases},
        }
    return out
