"""A modeled GPU step for the CPU engine (``benchmarks.vllm_cpu_engine``): a step of T scheduled tokens (prompt
chunks, one token per decoding row, draft slots, filler included) takes the project's linear verify-cost model's time
for T tokens (``specdec.eval.costmodel.CostModel``: ``t(1)`` plus a constant cost per further token). On an 8B-shaped
target a step reads the weights once and adds a roughly constant compute per token; ``H200_8B`` holds an H200's
(docs/gate.md gives the runs it was read from). With it:

- the plugin's clock advances by each step's modeled time, so its step-cost fit (``adaptive.StepCostModel``) sees a
  cost per verified token and its confidence cut acts as on the GPU (with the CPU engine's constant clock it sees
  none and drafts everything its drafter offers);
- a closed batch gets a modeled wall (its first request queued to its last token), and ``plain_wall`` gives no
  speculation's for the same requests, so a cell's ratio, the straggler included, can be read on the CPU;
- served traffic (``benchmarks.serve_proxy``) gets per-token times, and ``plain_serve`` no speculation's for the same
  arrivals, so a serve check's TPOT ratio as far as the GPU's verify work goes.

A model, not a measurement: it leaves out attention's growth with context, the host, CUDA graphs' padding and the
V1 runner. It ranks candidates by what they schedule; the GPU gate decides.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec.eval.costmodel import MS, CostModel

# An 8B-shaped step on one H200 (vLLM 0.26, bf16): the weights' read, then the compute of each scheduled token
H200_8B_BASE_MS = 4.5
H200_8B_TOKEN_MS = 0.02
H200_8B = CostModel(
    t1_ms=H200_8B_BASE_MS + H200_8B_TOKEN_MS,
    per_token_ms=H200_8B_TOKEN_MS,
    source=f"an 8B-shaped step on one H200: {H200_8B_BASE_MS} ms + {H200_8B_TOKEN_MS} ms a scheduled token",
)


def step_seconds(model: CostModel, tokens: int) -> float:
    """A step of ``tokens`` scheduled tokens on ``model``, in seconds (0: no step)."""
    return model.verify_ms(tokens) * MS if tokens > 0 else 0.0


def parse_step_model(text: str) -> CostModel | None:
    """``--step-model``: 'off' (None: the CPU engine's constant clock), 'h200-8b', or 'BASE_MS,TOKEN_US' (a step
    of T tokens takes BASE_MS + T x TOKEN_US)."""
    if text == "off":
        return None
    if text == "h200-8b":
        return H200_8B
    try:
        base_ms, token_us = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--step-model {text!r}: give 'off', 'h200-8b' or 'BASE_MS,TOKEN_US' (e.g. 4.5,20)") from None
    if base_ms <= 0 or token_us < 0:
        raise ValueError(f"--step-model {text!r}: BASE_MS must be > 0 and TOKEN_US >= 0 (e.g. 4.5,20)")
    token_ms = token_us / 1e3
    return CostModel(t1_ms=base_ms + token_ms, per_token_ms=token_ms, source=f"--step-model {text}")


def plain_wall(prompts: Sequence[int], outputs: Sequence[int], model: CostModel, *, max_batched: int) -> float:
    """No speculation's modeled wall for one closed batch: requests of ``prompts`` [n] prompt tokens and
    ``outputs`` [n] output tokens, all queued at once (``plain_serve`` with every arrival at 0), to the last token."""
    at_once = [0.0] * len(prompts)
    times = plain_serve(prompts, outputs, at_once, model, max_batched=max_batched, max_seqs=max(len(prompts), 1))
    return max((t[-1] for t in times if t), default=0.0)


def plain_serve(
    prompts: Sequence[int],
    outputs: Sequence[int],
    arrivals: Sequence[float],
    model: CostModel,
    *,
    max_batched: int,
    max_seqs: int,
    concurrency: int = 0,
) -> list[list[float]]:
    """No speculation serving requests of ``prompts`` [n] / ``outputs`` [n] tokens that arrive at ``arrivals`` [n]
    (seconds, ascending), on the modeled clock: each step admits what has arrived (at most ``concurrency`` in the
    engine, 0: no cap), gives every decoding request one token, then prompt chunks in admission order up to
    ``max_batched`` tokens and ``max_seqs`` requests. Per request, the modeled time of each of its output tokens."""
    times: list[list[float]] = [[] for _ in prompts]
    left_prompt, left_out = [int(p) for p in prompts], [int(o) for o in outputs]
    now, nxt, active = 0.0, 0, []  # active: admitted, unfinished, in admission order
    while nxt < len(prompts) or active:
        while nxt < len(prompts) and arrivals[nxt] <= now and not 0 < concurrency <= len(active):
            active.append(nxt)
            nxt += 1
        if not active:
            now = max(now, float(arrivals[nxt]))  # idle until the next arrival
            continue
        budget, tokens, emitted = max_batched, 0, []
        rows = active[:max_seqs]
        for i in rows:
            if left_prompt[i] == 0:
                left_out[i] -= 1
                emitted.append(i)
        budget -= len(emitted)
        tokens += len(emitted)
        for i in rows:
            if budget <= 0:
                break
            if left_prompt[i]:
                chunk = min(left_prompt[i], budget)
                left_prompt[i] -= chunk
                budget -= chunk
                tokens += chunk
                if left_prompt[i] == 0:
                    left_out[i] -= 1  # the prompt's last chunk samples the first token
                    emitted.append(i)
        now += step_seconds(model, tokens)
        for i in emitted:
            times[i].append(now)
        active = [i for i in active if left_out[i] > 0]
    return times
