"""One vLLM engine on the CPU without a model: vLLM 0.26's real schedulers and the plugin's real proposer, and a fake
model runner that verifies drafts against each request's fixed target sequence (greedy: the accepted prefix, then
the target's next token), drafts verified a step late as on the GPU:

- thread mode (the default for small targets): vLLM's synchronous ``Scheduler``; the drafts are taken after
  ``update_from_output`` and scheduled with the next step;
- schedule mode (the default for 8B-sized targets): vLLM's ``AsyncScheduler`` with the plugin's slot patch and the
  slot book attached; each step is scheduled before the output of the step before is processed, and its drafts are
  filled into the buffer that step handed out.

In both modes the runner keeps vLLM's guard near ``max_model_len``: its own ``GPUModelRunner._input_fits_in_drafter``
(with the plugin's table row for it applied, on or off as the plugin ships it), asked each step with the step's
longest sequence; where it says no, no draft is made and the next step verifies zeros, as vLLM's runner does.

Used by the low-acceptance tests (``tests/test_vllm_low_acceptance.py``) and by
the CPU proxy of the GPU gate (``benchmarks.gate_proxy``). Needs vLLM (``/opt/specdec-vllm-0.26.0``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from benchmarks.step_model import step_seconds
from specdec.eval.costmodel import CostModel

K = 16  # the plugin's default num_speculative_tokens
MAX_LEN = 1024
MAX_SEQS = 16
MAX_BATCHED_TOKENS = 4096
KV_BLOCKS = 4000
BLOCK = 16
STEP_S = 1e-3  # the proposer's clock advances this much per step (its step-cost fit sees no cost per token)
# The hf_config fields of a Llama 3 8B (what the plugin reads to estimate a served model's size: schedule mode)
LLAMA_8B_HF = SimpleNamespace(
    hidden_size=4096,
    num_hidden_layers=32,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
)


@dataclass
class Req:
    """One request: its target (prompt, then what the target model emits) and what the engine records."""

    target: list[int]
    prompt: int
    max_tokens: int
    accept_from: int | None  # context length from which its drafts would be accepted (None: never / unknown)
    ctx: list[int] = field(default_factory=list)
    steps: list[tuple[int, int, int]] = field(default_factory=list)  # per decoding step: (index, context, accepted)
    done_t: float = 0.0  # the engine's modeled time at its latest token (with a step model)

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


def vllm_config(
    model: str, *, max_len: int = MAX_LEN, max_seqs: int = MAX_SEQS, max_batched: int = MAX_BATCHED_TOKENS
) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig

    cache = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=False)
    cache.num_gpu_blocks = KV_BLOCKS
    return VllmConfig(
        model_config=ModelConfig(model=model, max_model_len=max_len, seed=0),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max(max_batched, max_len),
            max_model_len=max_len,
            is_encoder_decoder=False,
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

    from specdec.vllm_plugin.patches.features import Feature
    from specdec.vllm_plugin.patches.table import TABLE, apply_patches
    from specdec.vllm_plugin.versions import TESTED_VLLM_VERSIONS

    kv = KVCacheConfig(
        num_blocks=config.cache_config.num_gpu_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
            )
        ],
    )
    cls: Any = Scheduler
    if async_scheduling:

        class Patched(AsyncScheduler):
            pass

        rows = tuple(r for r in TABLE if r.feature in (Feature.SLOT_REGRANT, Feature.ADAPTIVE_SLOTS))
        report = apply_patches("all", version=TESTED_VLLM_VERSIONS[0], resolver=lambda name: Patched, table=rows)
        assert report.on(Feature.SLOT_REGRANT)
        cls = Patched
    return cls(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


def drafter_guard(proposer: Any, *, max_len: int) -> Any:
    """vLLM's ``GPUModelRunner._input_fits_in_drafter`` on a stand-in runner whose drafter is ``proposer``, with the
    plugin's patch row for it applied when the plugin ships it on (``patches.runner.NEAR_END_ON``)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from specdec.vllm_plugin.patches.features import Feature
    from specdec.vllm_plugin.patches.table import TABLE, apply_patches
    from specdec.vllm_plugin.versions import TESTED_VLLM_VERSIONS

    class Guard:
        _input_fits_in_drafter = GPUModelRunner._input_fits_in_drafter

    rows = tuple(r for r in TABLE if r.feature is Feature.NEAR_END)
    apply_patches("all", version=TESTED_VLLM_VERSIONS[0], resolver=lambda name: Guard, table=rows)
    runner = Guard()
    runner.drafter, runner.num_spec_tokens, runner.effective_drafter_max_model_len = proposer, K, max_len
    runner.speculative_config = SimpleNamespace(use_dflash=lambda: False)
    return runner


def plugin_proposer(config: Any, *, schedule: bool, options: dict[str, Any] | None = None) -> Any:
    """The plugin's proposer at its defaults, or with ``options`` (the speculative config's specdec keys): schedule
    mode for an 8B-shaped target, thread mode for a small one."""
    from specdec.vllm_plugin.proposer import SpecdecProposer

    cfg = SimpleNamespace(
        additional_config={"specdec": dict(options or {})},
        speculative_config=SimpleNamespace(num_speculative_tokens=K),
        model_config=SimpleNamespace(
            max_model_len=config.model_config.max_model_len, hf_config=LLAMA_8B_HF if schedule else None
        ),
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

    def __init__(
        self,
        model: str,
        *,
        schedule: bool,
        max_len: int = MAX_LEN,
        max_seqs: int = MAX_SEQS,
        max_batched: int = MAX_BATCHED_TOKENS,
        options: dict[str, Any] | None = None,
        step_model: CostModel | None = None,
    ) -> None:
        """``step_model``: each scheduled step advances the plugin's clock by its modeled GPU time (``now``, the
        engine's modeled seconds) instead of ``STEP_S``."""
        self.step_model, self.now = step_model, 0.0
        self.config = vllm_config(model, max_len=max_len, max_seqs=max_seqs, max_batched=max_batched)
        self.schedule, self.max_len = schedule, max_len
        self.sch = scheduler(self.config, async_scheduling=schedule)
        self.proposer = plugin_proposer(self.config, schedule=schedule, options=options)
        self.reqs: dict[str, Req] = {}
        self.queue: deque = deque()  # schedule mode: scheduled steps whose output the scheduler has not seen
        self.buffer: Any = None  # schedule mode: the draft buffer the last step handed out
        self.prev_rows: dict[str, int] = {}
        self.runner_state: dict[str, SimpleNamespace] = {}
        self.sched: Any = None
        self.guard = drafter_guard(self.proposer, max_len=max_len)
        self.zeroed_steps = 0  # steps vLLM's guard near max_model_len ran no drafter in
        self.engine_steps = 0  # steps that scheduled any token (what the GPU would run)
        # steps whose schedule gave any request a draft slot, and those slots: what the GPU verifies beyond a plain
        # step, filler included (a slot the drafting did not fill still costs its token), whatever the plugin counts
        self.slot_steps = 0
        self.slot_tokens = 0
        self.zeros: Any = None  # schedule mode: vLLM's zeroed drafts, when the last step's guard said no
        if schedule:
            runner = SimpleNamespace(device=torch.device("cpu"), max_num_reqs=max_seqs, num_spec_tokens=K)
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
        if self.step_model is None:
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
        self._advance(so)
        fits = self._fits(rows)
        self._count_slots(so)
        chunks = self._chunks(so)
        sampled = [
            [] if rid in chunks else self._verify(rid, list(so.scheduled_spec_decode_tokens.get(rid, [])))
            for rid in rows
        ]
        drafts = self._propose(rows, sampled, so) if fits else [[0] * K for _ in rows]  # vLLM's zeros
        self.sch.update_from_output(so, self._output(rows, sampled))
        collected = self.proposer.collect_deferred()  # the plugin's take hook; vLLM keeps its zeros where no fit
        self.sch.update_draft_token_ids(DraftTokenIds(rows, collected if collected is not None and fits else drafts))
        return True

    def _advance(self, so: Any) -> None:
        """The step ``so`` ran on the modeled GPU: the clock moves by its time (with a step model)."""
        if self.step_model is not None:
            self.now += step_seconds(self.step_model, sum(so.num_scheduled_tokens.values()))
            self.proposer.clock.t = self.now

    def _count_slots(self, so: Any) -> None:
        slots = sum(map(len, so.scheduled_spec_decode_tokens.values()))
        self.slot_steps += slots > 0
        self.slot_tokens += slots

    def _fits(self, rows: list[str]) -> bool:
        """vLLM's guard for the step just scheduled: its longest sequence (computed + scheduled tokens). Every
        scheduled step asks it once (``engine_steps`` counts them)."""
        self.engine_steps += 1
        longest = max(self.sch.requests[rid].num_computed_tokens for rid in rows)
        fits = bool(self.guard._input_fits_in_drafter(SimpleNamespace(max_seq_len=longest)))
        self.zeroed_steps += not fits
        return fits

    def _propose(self, rows: list[str], sampled: list[list[int]], so: Any) -> list[list[int]]:
        n = len(rows)
        tokens = np.zeros((n, self.max_len), np.int32)  # [rows, max_model_len] like vLLM's token_ids_cpu
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
        self._advance(so)
        self._count_slots(so)
        fits = self._fits(rows)
        if self.buffer is not None:  # this step's drafts, from the tokens of the step before (unless vLLM zeroed them)
            assert self.sched.fill(self.buffer) == (self.buffer is not self.zeros)
        sampled = torch.full((len(rows), K + 1), -1, dtype=torch.int32)  # [rows, k+1], -1: rejected
        emitted = []
        chunks = self._chunks(so)
        for row, rid in enumerate(rows):
            if rid in chunks:  # a prompt chunk before its last: no token (vLLM's runner discards its sample)
                emitted.append([])
                continue
            slots = len(so.scheduled_spec_decode_tokens.get(rid, ()))
            prev = self.prev_rows.get(rid)
            draft = self.buffer[prev].tolist()[:slots] if (prev is not None and slots) else []
            out = self._verify(rid, draft)
            sampled[row, : len(out)] = torch.tensor(out, dtype=torch.int32)
            emitted.append(out)
        self.sched.capture(sampled, rows, set(), requests=self.runner_state)
        for rid, out in zip(rows, emitted):
            if out:  # the runner's own record of a sampled token (a prompt chunk samples none)
                self.runner_state[rid].output_token_ids.append(-1)
        self.buffer = self.sched.submit(rows, k=None, eager=False) if fits else self.zeros_for(len(rows))
        self.prev_rows = {rid: i for i, rid in enumerate(rows)}
        return self._output(rows, emitted)

    def zeros_for(self, rows: int) -> Any:
        """vLLM's zeroed drafts (the guard said no): a buffer of its own, which the plugin's fill finds replaced."""
        self.zeros = torch.zeros((rows, K), dtype=torch.int32)  # [rows, k]
        return self.zeros

    # ----------------------------------------------------------------- shared
    def _chunks(self, so: Any) -> set[str]:
        """The rows of the step ``so`` that are prompt chunks short of their sequence's end (chunked prefill: more
        prompt tokens waiting than ``max_num_batched_tokens`` holds), which sample no token."""
        computed = {d.req_id: d.num_computed_tokens for d in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        spec = so.scheduled_spec_decode_tokens
        return {
            rid
            for rid, n in so.num_scheduled_tokens.items()
            if computed[rid] + n - len(spec.get(rid, ())) < len(self.reqs[rid].ctx)
        }

    def _verify(self, rid: str, draft: list[int]) -> list[int]:
        r = self.reqs[rid]
        before = len(r.ctx)
        out = r.emit(draft)
        r.done_t = self.now
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
        from specdec.vllm_plugin.proposer import INSTANCES

        attach_book(self.config, None)
        self.proposer.close()
        INSTANCES.discard(self.proposer)  # a closed engine's slot book is no process's live one (engine_timer)
