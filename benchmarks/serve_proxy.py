"""A CPU proxy of the GPU gate's low-acceptance serve check (``gate_serve``: ``vllm bench serve`` random dataset,
256 prompt tokens, 128 output tokens, 200 requests at 20/s, the server's default temperature 1): the same traffic
through vLLM 0.26's real ``AsyncScheduler`` and the plugin's real proposer in schedule mode
(``benchmarks.vllm_cpu_engine``), once per variant (``gate_proxy.VARIANTS``: back-off constants or plugin options).

    python -m benchmarks.serve_proxy [--variants off,loose] [--requests 200] [--rate 20] [--max-concurrency N]
        [--step-model off|h200-8b|BASE_MS,TOKEN_US] [--out F]

Prompts: token ids drawn uniformly from the vocabulary (as vLLM's random dataset draws them; seed ``--seed``).
Targets: the shared 53M target's own samples at temperature 1 (Hugging Face, float32, cached in
``device_inputs/serve_proxy_targets.json``, git-ignored): a draft token is accepted where it equals the sample, which
is how often rejection sampling accepts a one-token draft. Arrivals: a Poisson process at ``--rate`` per second on a
clock of ``STEP_MS`` per engine step (an 8B-shaped step of about 14 rows on an H200). Per variant: engine steps,
steps with a draft verified (what costs the batch: the GPU waits for the drafting and verifies a ragged batch),
drafted and accepted tokens, back-offs and recoveries, and per request the engine steps per emitted token after its
first (a TPOT in steps; median over requests). With a step model (``benchmarks.step_model``) the clock is the modeled
GPU time instead: requests arrive by it, and each variant's median TPOT in modeled ms is set beside no speculation's
for the same traffic (``plain_serve``).
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path
from typing import Any

from benchmarks.gate_proxy import (
    EOS,
    FILLER_TOKENS,
    VARIANTS,
    cached,
    counters,
    load_target,
    run_variants,
    sample,
    target_engine,
    variant_names,
    write_doc,
)
from benchmarks.prepare_prompts import FIRST_ORDINARY_ID
from benchmarks.step_model import parse_step_model, plain_serve
from specdec.eval.costmodel import CostModel
from specdec.paths import REPO_ROOT, TARGET_MODEL, model_path
from specdec.vllm_plugin.modes.phases import OUTER_PHASES

DEFAULT_TARGETS = REPO_ROOT / "device_inputs" / "serve_proxy_targets.json"
PROMPT_TOKENS, OUTPUT_TOKENS = 256, 128  # gate_serve's RANDOM_FLAGS
RATE, REQUESTS, SEED = 20.0, 200, 0  # gate_serve's REQUEST_RATE, NUM_PROMPTS, SEED
STEP_MS = 5.0  # one engine step of the 8B shape at the check's load: arrivals are turned into steps by it
MAX_LEN, MAX_SEQS, MAX_BATCHED = 2048, 256, 8192  # `vllm serve` defaults (max_num_seqs, tokens); length: the 53M's
GEN_BATCH = 8
TEMPERATURE = 1.0


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


def sampled_targets(ps: list[list[int]], path: Path, seed: int) -> list[list[int]]:
    """The target's temperature-1 continuations of ``ps`` (EOS ignored, as the benchmark's ``ignore_eos``), cached."""
    return cached(path, f"{TARGET_MODEL}:{len(ps)}:{seed}:{OUTPUT_TOKENS}:{TEMPERATURE}", lambda: _samples(ps, seed))


def _samples(ps: list[list[int]], seed: int) -> list[list[int]]:
    import torch
    from tqdm import tqdm

    model = load_target()
    torch.manual_seed(seed)
    out: list[list[int]] = []
    for s in tqdm(range(0, len(ps), GEN_BATCH), desc="target samples", unit="batch"):
        ids = torch.tensor(ps[s : s + GEN_BATCH])  # [batch, PROMPT_TOKENS]: equal lengths, no padding
        out += sample(model, ids, temperature=TEMPERATURE, max_new_tokens=OUTPUT_TOKENS, min_new_tokens=OUTPUT_TOKENS)
    return out  # [OUTPUT_TOKENS] each


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Each request's arrival in seconds (a Poisson process at ``rate`` per second; ``inf``: all at 0)."""
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def arrivals(n: int, rate: float, seed: int) -> list[int]:
    """Each request's arrival, in engine steps of ``STEP_MS`` (the constant clock's)."""
    return [int(t * 1000.0 / STEP_MS) for t in arrival_times(n, rate, seed)]


def replay(
    ps: list[list[int]],
    outs: list[list[int]],
    at: list[int],
    options: dict[str, Any] | None,
    *,
    concurrency: int = 0,
    timed: tuple[list[float], CostModel] | None = None,
) -> dict[str, Any]:
    """One engine through the traffic: the plugin's counters and the requests' steps per token. ``concurrency`` > 0:
    a request arrives only while fewer than that many are in the engine (``vllm bench serve --max-concurrency``).
    ``timed`` = (arrivals in seconds, step model): the engine's clock is the modeled GPU time, requests arrive by it,
    and the result adds the median TPOT in modeled ms, with no speculation's for the same traffic (``plain_serve``)."""
    from benchmarks.vllm_cpu_engine import Req
    from specdec.vllm_plugin.observe import observe

    model = timed[1] if timed else None
    engine = target_engine(options, max_len=MAX_LEN, max_seqs=MAX_SEQS, max_batched=MAX_BATCHED, step_model=model)
    timer = HostTimer()
    observe(timer)  # the plugin's timing hook: schedule mode's phases, wall time on this (the engine's) thread
    reqs = [Req([*p, *o, *[EOS] * FILLER_TOKENS], len(p), len(o), None) for p, o in zip(ps, outs)]
    emitted_at: list[list[float]] = [[] for _ in reqs]  # per request: the step (or modeled time) of each new token
    nxt, step, peak = 0, 0, 0  # peak: the most requests in the engine at once
    try:
        while nxt < len(reqs) or engine.sch.has_unfinished_requests() or engine.queue:
            now = engine.now if timed else step
            due = timed[0] if timed else at
            if timed and nxt < len(reqs) and not (engine.sch.has_unfinished_requests() or engine.queue):
                engine.now = now = max(now, due[nxt])  # idle: the clock runs on to the next arrival
            while nxt < len(reqs) and due[nxt] <= now and not 0 < concurrency <= len(engine.sch.requests):
                engine.add(f"r{nxt}", reqs[nxt])
                nxt += 1
            peak = max(peak, len(engine.sch.requests))
            before = [len(r.ctx) for r in reqs[:nxt]]
            engine.step()
            stamp = engine.now if timed else step
            for i, r in enumerate(reqs[:nxt]):
                emitted_at[i] += [stamp] * (len(r.ctx) - before[i])
            step += 1
        assert all(r.ctx[r.prompt :][: r.max_tokens] == o for r, o in zip(reqs, outs)), "outputs differ"
        res = counters(engine)
    finally:
        observe(None)
        engine.close()
    host = {phase: 1e3 * s / max(res["engine_steps"], 1) for phase, s in sorted(timer.seconds.items())}
    out = {
        **res,
        "wall_steps": step,
        "peak_requests": peak,
        "host_ms_per_step": host,  # per phase (``modes/phases.py``; wait and tokens run inside fill)
    }
    if timed is None:
        out["steps_per_token_p50"] = median_tpot(emitted_at)
        return out
    plain = plain_serve(
        [r.prompt for r in reqs], [r.max_tokens for r in reqs], timed[0], timed[1],
        max_batched=MAX_BATCHED, max_seqs=MAX_SEQS, concurrency=concurrency,
    )  # fmt: skip
    out["steps_per_token_p50"] = float("nan")
    out["tpot_ms_p50"], out["plain_tpot_ms_p50"] = 1e3 * median_tpot(emitted_at), 1e3 * median_tpot(plain)
    return out


def median_tpot(times: list[list[float]]) -> float:
    """The median over requests of (last - first) / (tokens - 1): per output token after the first."""
    return statistics.median((e[-1] - e[0]) / (len(e) - 1) for e in times if len(e) > 1)


class HostTimer:
    """A ``DraftingObserver``: the wall seconds of each drafting phase, summed (this machine's CPU: a host cost
    relative to another variant's in the same run, not a server's)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def drafting_phase(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


def engine_thread_ms(host: dict[str, float]) -> float:
    """The plugin's engine-thread milliseconds a step: the phases vLLM's loop calls (``OUTER_PHASES``)."""
    return sum(host.get(p, 0.0) for p in OUTER_PHASES)


def table(results: dict[str, dict[str, Any]]) -> str:
    """One row per variant: its counters, steps per token (and against the first variant's), the plugin's
    engine-thread ms a step on this CPU; with a step model, the median TPOT in modeled ms against no speculation's."""
    cols = ["engine_steps", "slot_steps", "slot_tokens", "drafted_steps", "drafted", "accepted", "back_offs"]
    cols += ["recoveries", "withheld"]
    head = f"{'variant':<14} " + " ".join(f"{c[:13]:>13}" for c in cols) + f" {'steps/token':>11} {'x':>6}"
    head += f" {'host ms':>7} {'TPOT ms':>8} {'x plain':>7}"
    lines = [head, "-" * len(head)]
    base = next(iter(results.values()))["steps_per_token_p50"]
    for v, r in results.items():
        nums = " ".join(f"{r[c]:>13.0f}" for c in cols)
        spt = r["steps_per_token_p50"]
        host = engine_thread_ms(r.get("host_ms_per_step", {}))
        tpot, plain = r.get("tpot_ms_p50"), r.get("plain_tpot_ms_p50")
        timed = f"{tpot:>8.3f} {tpot / plain:>7.3f}" if tpot and plain else f"{'-':>8} {'-':>7}"
        steps = f"{spt:>11.3f} {spt / base:>6.3f}" if spt == spt else f"{'-':>11} {'-':>6}"  # NaN: timed run
        lines.append(f"{v:<14} {nums} {steps} {host:>7.3f} {timed}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="off,loose", help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--requests", type=int, default=REQUESTS)
    ap.add_argument("--rate", type=float, default=RATE, help="requests per second (inf: all at once)")
    ap.add_argument("--max-concurrency", type=int, default=0, help="at most this many in the engine (0: no cap)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--targets", default=str(DEFAULT_TARGETS), help="the target's samples (cache, git-ignored)")
    ap.add_argument("--out", default="", help="JSON to write")
    ap.add_argument(
        "--step-model",
        default="off",
        help="off: arrivals by engine steps of STEP_MS; h200-8b or BASE_MS,TOKEN_US: the clock is the modeled GPU "
        "step (benchmarks.step_model), with the median TPOT in modeled ms against no speculation's",
    )
    args = ap.parse_args(argv)
    try:
        model = parse_step_model(args.step_model)
    except ValueError as exc:
        ap.error(str(exc))
    names = variant_names(ap, args.variants)
    from transformers import AutoConfig

    vocab = int(AutoConfig.from_pretrained(str(model_path(TARGET_MODEL))).vocab_size)
    ps = prompts(args.requests, vocab, args.seed)
    outs = sampled_targets(ps, Path(args.targets), args.seed)
    at = arrivals(args.requests, args.rate, args.seed)
    timed = (arrival_times(args.requests, args.rate, args.seed), model) if model else None
    results = run_variants(
        names, lambda options: replay(ps, outs, at, options, concurrency=args.max_concurrency, timed=timed)
    )
    print(table(results))
    if args.out:
        settings = {"step_ms": STEP_MS, "rate": args.rate, "requests": args.requests, "seed": args.seed}
        settings["step_model"] = args.step_model
        settings["max_concurrency"] = args.max_concurrency
        fields = {"settings": settings, "results": results}
        write_doc(args.out, command="benchmarks.serve_proxy", argv=argv, names=names, fields=fields)


if __name__ == "__main__":
    main()
