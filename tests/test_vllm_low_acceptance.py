"""The low-acceptance policy in one long-lived engine, through vLLM 0.26's real schedulers on the CPU.

The plugin's proposer (``SpecdecProposer``, its defaults) drafts for a fake model runner that verifies drafts against
each request's fixed target sequence (greedy: the accepted prefix, then the target's next token), drafts verified a
step late as on the GPU:

- thread mode (the default for small targets): vLLM's synchronous ``Scheduler``; the drafts are taken after
  ``update_from_output`` and scheduled with the next step;
- schedule mode (the default for 8B-sized targets): vLLM's ``AsyncScheduler`` with the plugin's slot patch and the
  slot book attached; each step is scheduled before the output of the step before is processed, and its drafts are
  filled into the buffer that step handed out.

One engine serves, in order: a batch whose drafts are not accepted (with requests whose text turns repetitive midway)
and requests whose drafts would be accepted arriving one at a time into it; an idle gap; a batch of such requests;
a batch of one. Each request whose drafts would be accepted must have a draft verified with an accepted token within
``PROBE_FIRST_AFTER`` steps of the first step whose drafts could be (the drafts are drafted from a context that holds
the repetition); every output is the target's.
"""

from __future__ import annotations

import importlib.util
import random
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from core_support import LLAMA_8B_HF
from specdec.drafters.suffix import native_available
from specdec.vllm_plugin.core.backoff import PROBE_FIRST_AFTER

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not importable (scripts/test.sh has it)"),
    pytest.mark.skipif(not native_available(), reason="native suffix core not built"),
]

K = 16  # the plugin's default num_speculative_tokens
MAX_LEN = 1024
MAX_SEQS = 16
LOW_VOCAB = (20, 32)  # low-acceptance text: random tokens over a few ids (the drafter always finds a wrong match)
HIGH_VOCAB = (100, 4000)  # each repeated segment: random tokens over many ids (unique in the engine)
SEGMENT = 32  # tokens of a repeated segment
TURN_AFTER = 40  # a turning request's random tokens before its text starts repeating its prompt's segment
STEP_S = 1e-3  # the proposer's clock advances this much per step (its step-cost fit sees no cost per token)


@dataclass
class Req:
    """One request: its target (prompt, then what the target model emits) and what the test records."""

    target: list[int]
    prompt: int
    max_tokens: int
    accept_from: int | None  # context length from which its drafts would be accepted (None: never)
    ctx: list[int] = field(default_factory=list)
    steps: list[tuple[int, int, int]] = field(default_factory=list)  # per decoding step: (index, context, accepted)

    def emit(self, draft: list[int]) -> list[int]:
        """Greedy verification: the draft's prefix the target agrees with, then the target's next token."""
        out = []
        for d in [*draft, None]:
            want = self.target[len(self.ctx)]
            out.append(want)
            self.ctx.append(want)
            if d != want:
                break
        return out


def random_tokens(rng: random.Random, n: int, vocab: tuple[int, int]) -> list[int]:
    return [rng.randrange(*vocab) for _ in range(n)]


def low_request(rng: random.Random, max_tokens: int) -> Req:
    t = random_tokens(rng, 48 + max_tokens + 2 * K + 8, LOW_VOCAB)
    return Req(t, 48, max_tokens, None)


def high_request(rng: random.Random, max_tokens: int) -> Req:
    """Its prompt holds a segment and the segment's start again; it goes on repeating the segment."""
    seg = random_tokens(rng, SEGMENT, HIGH_VOCAB)
    t = (seg * (3 + (max_tokens + 2 * K) // SEGMENT))[: 6 + SEGMENT + max_tokens + 2 * K + 8]
    return Req(t, SEGMENT + 6, max_tokens, SEGMENT + 6)


def turning_request(rng: random.Random, max_tokens: int) -> Req:
    """Random text, then (after TURN_AFTER tokens) a copy of its prompt's segment, over and over."""
    seg = random_tokens(rng, SEGMENT, HIGH_VOCAB)
    prompt = random_tokens(rng, 24, LOW_VOCAB) + seg + random_tokens(rng, 16, LOW_VOCAB)
    t = prompt + random_tokens(rng, TURN_AFTER, LOW_VOCAB) + seg * (3 + max_tokens // SEGMENT)
    # the first copied token is unique to the segment: drafts from a context holding two of them are right
    return Req(t[: len(prompt) + max_tokens + 2 * K + 8], len(prompt), max_tokens, len(prompt) + TURN_AFTER + 2)


def vllm_config(model: str) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig

    cache = CacheConfig(block_size=16, cache_dtype="auto", enable_prefix_caching=False)
    cache.num_gpu_blocks = 4000
    return VllmConfig(
        model_config=ModelConfig(model=model, max_model_len=MAX_LEN, seed=0),
        scheduler_config=SchedulerConfig(
            max_num_seqs=MAX_SEQS, max_num_batched_tokens=4096, max_model_len=MAX_LEN, is_encoder_decoder=False
        ),
        cache_config=cache,
        device_config=DeviceConfig("cpu"),
        speculative_config=SpeculativeConfig(
            method="ngram", num_speculative_tokens=K, prompt_lookup_max=3, prompt_lookup_min=2
        ),
    )


def scheduler(config: Any, *, async_scheduling: bool) -> Any:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from patch_support import patch
    from specdec.vllm_plugin.patches.features import Feature

    kv = KVCacheConfig(
        num_blocks=config.cache_config.num_gpu_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
            )
        ],
    )
    cls: Any = Scheduler
    if async_scheduling:

        class Patched(AsyncScheduler):
            pass

        assert patch(Patched, Feature.SLOT_REGRANT, Feature.ADAPTIVE_SLOTS).on(Feature.SLOT_REGRANT)
        cls = Patched
    return cls(
        vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config), block_size=16
    )


def plugin_proposer(config: Any, *, schedule: bool) -> Any:
    """The plugin's proposer at its defaults (schedule mode for an 8B-shaped target, thread mode for a small one)."""
    from specdec.vllm_plugin.proposer import SpecdecProposer

    cfg = SimpleNamespace(
        additional_config={"specdec": {}},
        speculative_config=SimpleNamespace(num_speculative_tokens=K),
        model_config=SimpleNamespace(max_model_len=MAX_LEN, hf_config=LLAMA_8B_HF if schedule else None),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        scheduler_config=config.scheduler_config,
    )
    proposer = SpecdecProposer(cfg, patch_runner=False)
    assert proposer.schedule_mode == schedule and proposer.threaded == (not schedule)
    clock = SimpleNamespace(t=0.0)
    proposer.core.clock = lambda: clock.t
    proposer.clock = clock
    return proposer


class Engine:
    """One engine over vLLM's scheduler and the plugin's proposer (see the module docstring)."""

    def __init__(self, *, schedule: bool) -> None:
        from specdec.paths import TARGET_MODEL, model_path

        if not model_path(TARGET_MODEL).is_dir():
            pytest.skip("the shared target model is not here (SPECDEC_SHARED)")
        self.config = vllm_config(str(model_path(TARGET_MODEL)))
        self.schedule = schedule
        self.sch = scheduler(self.config, async_scheduling=schedule)
        self.proposer = plugin_proposer(self.config, schedule=schedule)
        self.reqs: dict[str, Req] = {}
        self.queue: deque = deque()  # schedule mode: scheduled steps whose output the scheduler has not seen
        self.buffer: Any = None  # schedule mode: the draft buffer the last step handed out
        self.prev_rows: dict[str, int] = {}
        self.runner_state: dict[str, SimpleNamespace] = {}
        self.sched: Any = None
        if schedule:
            runner = SimpleNamespace(device=torch.device("cpu"), max_num_reqs=MAX_SEQS, num_spec_tokens=K)
            self.sched = self.proposer.scheduled_for(runner)
            assert self.sched.slot_book is not None  # adaptive slots, attached to this engine's config
            self.proposer.vllm_config = self.config  # the scheduler reads the book from its config
            from specdec.vllm_plugin.modes.slots import attach_book

            attach_book(self.config, self.sched.slot_book)

    def add(self, rid: str, req: Req) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        req.ctx = list(req.target[: req.prompt])
        self.reqs[rid] = req
        self.runner_state[rid] = SimpleNamespace(prompt_token_ids=list(req.ctx), output_token_ids=[])
        params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
        self.sch.add_request(
            Request(request_id=rid, prompt_token_ids=list(req.ctx), sampling_params=params, pooling_params=None)
        )

    def run(self, max_steps: int = 10_000) -> None:
        """Step until every request finished."""
        for _ in range(max_steps):
            if not self.step():
                return
        raise AssertionError("the engine did not finish its requests")

    def step(self) -> bool:
        self.proposer.clock.t += STEP_S
        return self._async_step() if self.schedule else self._sync_step()

    # ----------------------------------------------------------------- thread mode: vLLM's synchronous loop
    def _sync_step(self) -> bool:
        from vllm.v1.outputs import DraftTokenIds

        if not self.sch.has_unfinished_requests():
            return False
        so = self.sch.schedule()
        rows = list(so.num_scheduled_tokens)
        if not rows:
            return True
        sampled = [self._verify(rid, list(so.scheduled_spec_decode_tokens.get(rid, []))) for rid in rows]
        drafts = self._propose(rows, sampled, so)
        self.sch.update_from_output(so, self._output(rows, sampled))
        collected = self.proposer.collect_deferred()
        self.sch.update_draft_token_ids(DraftTokenIds(rows, collected if collected is not None else drafts))
        return True

    def _propose(self, rows: list[str], sampled: list[list[int]], so: Any) -> list[list[int]]:
        n = len(rows)
        tokens = np.zeros((n, MAX_LEN), np.int32)  # [rows, max_model_len] like vLLM's token_ids_cpu
        lengths, prompts = np.zeros(n, np.int32), np.zeros(n, np.int32)
        for i, rid in enumerate(rows):
            r = self.reqs[rid]
            tokens[i, : len(r.ctx)] = r.ctx
            lengths[i], prompts[i] = len(r.ctx), r.prompt
        self.proposer.bind_step(SimpleNamespace(req_ids=rows, num_prompt_tokens=prompts), so)
        return self.proposer.propose(sampled, lengths, tokens)

    # ----------------------------------------------------------------- schedule mode: vLLM's async loop
    def _async_step(self) -> bool:
        scheduled = False
        if self.sch.has_unfinished_requests():
            so = self.sch.schedule()
            if so.num_scheduled_tokens:
                self.queue.append((so, self._execute(so)))
                scheduled = True
        if self.queue and (len(self.queue) >= 2 or not scheduled):
            so0, out0 = self.queue.popleft()
            self.sch.update_from_output(so0, out0)
        return scheduled or bool(self.queue) or self.sch.has_unfinished_requests()

    def _execute(self, so: Any) -> Any:
        rows = list(so.num_scheduled_tokens)
        if self.buffer is not None:
            assert self.sched.fill(self.buffer)  # this step's drafts, from the tokens of the step before
        sampled = torch.full((len(rows), K + 1), -1, dtype=torch.int32)  # [rows, k+1], -1: rejected
        emitted = []
        for row, rid in enumerate(rows):
            slots = len(so.scheduled_spec_decode_tokens.get(rid, ()))
            prev = self.prev_rows.get(rid)
            draft = self.buffer[prev].tolist()[:slots] if (prev is not None and slots) else []
            out = self._verify(rid, draft)
            sampled[row, : len(out)] = torch.tensor(out, dtype=torch.int32)
            emitted.append(out)
        self.sched.capture(sampled, rows, set(), requests=self.runner_state)
        for rid in rows:
            self.runner_state[rid].output_token_ids.append(-1)
        self.buffer = self.sched.submit(rows, k=None, eager=False)
        self.prev_rows = {rid: i for i, rid in enumerate(rows)}
        return self._output(rows, emitted)

    # ----------------------------------------------------------------- shared
    def _verify(self, rid: str, draft: list[int]) -> list[int]:
        r = self.reqs[rid]
        before = len(r.ctx)
        out = r.emit(draft)
        if before > r.prompt:  # a decoding row (a prefill's first token verifies nothing)
            r.steps.append((len(r.steps), before, len(out) - 1))
        return out

    @staticmethod
    def _output(rows: list[str], sampled: list[list[int]]) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        return ModelRunnerOutput(
            req_ids=rows, req_id_to_index={r: i for i, r in enumerate(rows)}, sampled_token_ids=sampled
        )

    def close(self) -> None:
        from specdec.vllm_plugin.modes.slots import attach_book

        attach_book(self.config, None)
        self.proposer.close()


def late_steps(req: Req) -> int | None:
    """Decoding steps from the first one whose drafts would be accepted to the first with an accepted draft token
    (None: the request never got to such a step)."""
    start = next((i for i, (_, before, _) in enumerate(req.steps) if before >= req.accept_from), None)
    if start is None:
        return None
    hit = next((i for i in range(start, len(req.steps)) if req.steps[i][2] > 0), len(req.steps))
    return hit - start


def serve_scenario(engine: Engine, seed: int = 0) -> dict[str, Req]:
    """A low-acceptance batch with turning requests, high-acceptance requests arriving one at a time into it, an idle
    gap, a batch of high-acceptance requests, a batch of one. Returns the requests whose drafts would be accepted."""
    rng = random.Random(seed)
    for i in range(8):
        engine.add(f"low{i}", low_request(rng, 120 if i < 4 else 260))
    for i in range(2):
        engine.add(f"turn{i}", turning_request(rng, 110))
    for _ in range(60):  # the batch backs off
        engine.step()
    for i in range(4):  # one at a time, into the low batch
        engine.add(f"one{i}", high_request(rng, 60))
        for _ in range(12):
            engine.step()
    engine.run()
    for _ in range(5):  # an idle gap: nothing to schedule
        engine.step()
    for i in range(8):
        engine.add(f"batch{i}", high_request(rng, 60))
    engine.run()
    engine.add("single", high_request(rng, 60))
    engine.run()
    return {rid: r for rid, r in engine.reqs.items() if r.accept_from is not None}


@pytest.mark.parametrize("schedule", [False, True], ids=["thread", "schedule"])
def test_requests_whose_drafts_would_be_accepted_draft_within_the_bound_in_a_long_lived_engine(schedule):
    """As the module docstring says."""
    engine = Engine(schedule=schedule)
    try:
        high = serve_scenario(engine)
    finally:
        engine.close()
    for rid, r in engine.reqs.items():  # lossless: every output is the target's
        assert r.ctx == r.target[: len(r.ctx)] and len(r.ctx) >= r.prompt + r.max_tokens, rid
    late = {rid: late_steps(r) for rid, r in high.items()}
    assert all(n is not None for n in late.values()), late
    assert max(late.values()) <= PROBE_FIRST_AFTER, late
    # and once back, they keep drafting: most of their later steps verify accepted tokens
    for rid, r in high.items():
        start = next(i for i, (_, before, _) in enumerate(r.steps) if before >= r.accept_from)
        after = [acc for _, _, acc in r.steps[start + PROBE_FIRST_AFTER :]]
        assert sum(a > 0 for a in after) >= 0.8 * len(after), (rid, after)
    lows = [acc for rid, r in engine.reqs.items() if rid.startswith("low") for _, _, acc in r.steps[-40:]]
    assert sum(lows) <= 0.25 * len(lows)  # the low requests stayed low (the scenario is what it says)
