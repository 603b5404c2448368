"""A stand-in for vLLM's ``LLM`` in the GPU gate's worker (``gate --fake``), so its whole flow runs on the CPU.

Deterministic: outputs come from each prompt's ids (some prompts loop, as the 53M target does), and time is a
fake clock (``clock()``) that each ``generate`` call advances by its engine steps x a step cost, so repeats agree
exactly and every verdict of a dry run is the same on every machine. Per method: emitted tokens per drafted step
(``FAKE_EMIT``; no speculation emits one token per step and reports no counters), step cost over no speculation's
(``FAKE_STEP_COST``), engine start (``FAKE_START_S``) and KV-cache blocks (``FAKE_BLOCKS``).
"""

from __future__ import annotations

import hashlib
import math
import random
from types import SimpleNamespace
from typing import Any

FAKE_EMIT = {"nospec": 1.0, "nospec-v1": 1.0, "suffix": 2.0, "specdec": 3.2, "specdec-before": 1.0, "ngram": 1.8}
FAKE_EMIT["specdec-sync"] = FAKE_EMIT["specdec-schedule"] = FAKE_EMIT["specdec"]
FAKE_STEP_COST = {"nospec": 1.0, "nospec-v1": 1.02, "suffix": 1.05, "specdec": 1.05, "specdec-before": 1.05}
FAKE_STEP_COST |= {"ngram": 1.05, "specdec-sync": 1.3}
FAKE_START_S = {"nospec": 100.0, "nospec-v1": 101.0, "suffix": 110.0, "specdec": 112.0, "specdec-before": 140.0}
FAKE_BLOCKS = {"nospec": 10_000, "nospec-v1": 10_000, "suffix": 9_900, "specdec": 9_800, "specdec-before": 9_500}
BLOCK_SIZE = 16
STEP_MS = 8.0  # a batch of one's step on the fake clock
STEP_MS_PER_REQUEST = 0.05  # what each request in the batch adds
VOCAB = 16_384
LOOP_EVERY = 4  # every LOOP_EVERY-th prompt (by its hash) loops on a short phrase


class FakeLLM:
    """What the gate's worker uses of ``vllm.LLM``: ``generate``, ``get_metrics``, ``reset_prefix_cache`` and
    ``llm_engine.vllm_config``; plus ``clock()`` (the fake time) and ``fake_start_s``."""

    def __init__(self, method: str, *, tp: int = 1, spec: dict[str, Any] | None = None) -> None:
        self.method, self.now = method, 0.0
        self.emit, self.cost = FAKE_EMIT.get(method, 1.0), FAKE_STEP_COST.get(method, 1.0)
        self.fake_start_s = FAKE_START_S.get(method, 100.0)
        self.counters = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
        self.spec = spec
        cache = SimpleNamespace(num_gpu_blocks=FAKE_BLOCKS.get(method, 10_000), block_size=BLOCK_SIZE)
        spec_cfg = None if spec is None else SimpleNamespace(**{"num_speculative_tokens": 8, **spec})
        self.llm_engine = SimpleNamespace(
            vllm_config=SimpleNamespace(
                cache_config=cache,
                speculative_config=spec_cfg,
                additional_config={},
                parallel_config=SimpleNamespace(tensor_parallel_size=tp),
            )
        )

    def clock(self) -> float:
        return self.now

    def reset_prefix_cache(self) -> bool:
        return True

    def generate(self, prompts: list[dict[str, Any]], params: list[Any], use_tqdm: bool = False) -> list[Any]:
        del use_tqdm
        outs = [_tokens(p["prompt_token_ids"], sp) for p, sp in zip(prompts, params)]
        steps = [math.ceil(len(o) / self.emit) for o in outs]
        step_s = self.cost * (STEP_MS + STEP_MS_PER_REQUEST * len(prompts)) / 1e3
        start = self.now
        self.now += max(steps, default=0) * step_s
        if self.spec is not None:
            self.counters["drafts"] += sum(steps)
            self.counters["draft_tokens"] += 8 * sum(steps)
            self.counters["accepted_tokens"] += sum(len(o) - s for o, s in zip(outs, steps))
        return [  # engine-core timestamps as vLLM's RequestOutput.metrics has them (first token after one step)
            SimpleNamespace(
                outputs=[SimpleNamespace(token_ids=o)],
                metrics=SimpleNamespace(first_token_ts=start + step_s, last_token_ts=start + n * step_s),
            )
            for o, n in zip(outs, steps)
        ]

    def get_metrics(self) -> list[Any]:
        if self.spec is None:
            return []
        return [
            SimpleNamespace(name=f"vllm:spec_decode_num_{k}", labels={"engine": "0"}, value=v)
            for k, v in self.counters.items()
        ]


def _tokens(prompt: list[int], sp: Any) -> list[int]:
    """A deterministic output: up to ``sp.max_tokens`` tokens (EOS ends some early), looping for some prompts;
    with temperature > 0 the request's seed changes it."""
    key = hashlib.sha1(repr((prompt, getattr(sp, "seed", None) if sp.temperature else None)).encode()).digest()
    rng = random.Random(key)
    n = sp.max_tokens if rng.random() < 0.5 else rng.randint(1, sp.max_tokens)
    if key[0] % LOOP_EVERY == 0:
        phrase = [rng.randrange(2, VOCAB) for _ in range(5)]
        return [phrase[i % len(phrase)] for i in range(n)]
    return [rng.randrange(2, VOCAB) for _ in range(n)]


def fake_params(*, temperature: float, max_tokens: int, seed: int | None) -> Any:
    """What the worker's requests carry on the fake engine (``vllm.SamplingParams``' fields it reads)."""
    return SimpleNamespace(temperature=temperature, max_tokens=max_tokens, seed=seed)
