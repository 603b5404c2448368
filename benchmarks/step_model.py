"""A modeled GPU step for the CPU engine (``benchmarks.vllm_cpu_engine``): a step of T scheduled tokens (prompt
chunks, one token per decoding row, draft slots, filler included) takes ``base_s + token_s * T`` seconds. On an
8B-shaped target a step reads the weights once (``base_s``) and adds a roughly constant compute per token
(``token_s``); the defaults are an H200's, read off the gate's own runs (below). With it:

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
from dataclasses import dataclass

# An 8B step on one H200 (vLLM 0.26, bf16): a decoding step of one to a few rows takes about 4.5 ms (the gate's
# batches of one without speculation), and each scheduled token adds about 20 µs (a batch's prompt chunks of 16,384
# tokens, and verify steps of 100 rows x 5 tokens against plain ones, in the gate's drafted-step traces).
H200_8B_BASE_S = 4.5e-3
H200_8B_TOKEN_S = 2.0e-5


@dataclass(frozen=True)
class StepModel:
    """A step's modeled seconds: ``base_s + token_s * tokens``."""

    base_s: float = H200_8B_BASE_S
    token_s: float = H200_8B_TOKEN_S

    def cost(self, tokens: int) -> float:
        return self.base_s + self.token_s * tokens if tokens > 0 else 0.0


def parse_step_model(text: str) -> StepModel | None:
    """``--step-model``: 'off' (None: the CPU engine's constant clock), 'h200-8b', or 'BASE_MS,TOKEN_US'."""
    if text == "off":
        return None
    if text == "h200-8b":
        return StepModel()
    try:
        base_ms, token_us = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--step-model {text!r}: give 'off', 'h200-8b' or 'BASE_MS,TOKEN_US' (e.g. 4.5,20)") from None
    if base_ms <= 0 or token_us < 0:
        raise ValueError(f"--step-model {text!r}: BASE_MS must be > 0 and TOKEN_US >= 0 (e.g. 4.5,20)")
    return StepModel(base_ms / 1e3, token_us / 1e6)


def plain_wall(prompts: Sequence[int], outputs: Sequence[int], model: StepModel, *, max_batched: int) -> float:
    """No speculation's modeled wall for one closed batch: requests of ``prompts`` [n] prompt tokens and
    ``outputs`` [n] output tokens, all queued at once, scheduled as vLLM's scheduler does with chunked prefill
    (each step: one token per decoding request first, then prompt chunks in arrival order up to ``max_batched``
    tokens; a request's last prompt chunk also samples its first output token)."""
    left_prompt = [int(p) for p in prompts]  # [n] prompt tokens not yet computed
    left_out = [int(o) for o in outputs]  # [n] output tokens not yet sampled
    wall = 0.0
    while any(left_out):
        budget, tokens = max_batched, 0
        decoding = [i for i, (p, o) in enumerate(zip(left_prompt, left_out)) if p == 0 and o > 0]
        for i in decoding:
            left_out[i] -= 1
        budget -= len(decoding)
        tokens += len(decoding)
        for i, p in enumerate(left_prompt):
            if budget <= 0:
                break
            if p == 0:
                continue
            chunk = min(p, budget)
            left_prompt[i] -= chunk
            budget -= chunk
            tokens += chunk
            if left_prompt[i] == 0 and left_out[i] > 0:
                left_out[i] -= 1  # the prompt's last chunk samples the first token
        wall += model.cost(tokens)
    return wall


def plain_serve(
    prompts: Sequence[int],
    outputs: Sequence[int],
    arrivals: Sequence[float],
    model: StepModel,
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
        now += model.cost(tokens)
        for i in emitted:
            times[i].append(now)
        active = [i for i in active if left_out[i] > 0]
    return times
