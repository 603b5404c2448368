"""Per-request bookkeeping of the vLLM proposer, free of vLLM (CPU-tested with fake vLLM-shaped inputs).

Each step vLLM hands the proposer, row by row of its input batch, the tokens the verifier just emitted
(``sampled_token_ids[i]``: accepted draft tokens + the bonus token; empty for partial prefills), the row's
context length after them (``num_tokens_no_spec[i]``) and the context itself (``token_ids_cpu[i, :n]``).
Rows move between steps, so state is keyed by vLLM's request id (``req_ids[i]``, from the runner's input batch).

``ProposerCore.step`` takes the step's decisions (``StepPlan``), keeps the statistics and the step-cost fit, and hands
the rows to its drafting engine (``engine.StepEngine``: the native lane or the Python engine), which turns them into
drafter lifecycle calls (start / extend / stop, keyed by request id), drafting under a deadline, and chain drafts that
never exceed ``num_speculative_tokens`` nor reach past ``max_model_len``. A request seen with a context length that
does not follow from what the drafter knows (preemption, recompute) is restarted from the full context ("resync").
Requests absent from the batch are stopped (finished, aborted or preempted; a preempted one is restarted when it
returns). What the core reports (statistics, the periodic log line, the drafter's gauges) is ``core/reporting.py``'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from specdec.drafters.base import Drafter, DraftGuard
from specdec.drafters.suffix_lane import LaneDecisions
from specdec.vllm_plugin.core.adaptive import StepCostModel
from specdec.vllm_plugin.core.batch import StepBatch
from specdec.vllm_plugin.core.engine import LANE_MAX_OVERRUNS, LaneEngine, StepEngine, StepPlan
from specdec.vllm_plugin.core.lane import Lane, LaneCounts, find_lane, lane_step_tokens
from specdec.vllm_plugin.core.policy import DraftingPolicy
from specdec.vllm_plugin.core.python_engine import PythonEngine, chain_draft
from specdec.vllm_plugin.core.reporting import ProposerReporting
from specdec.vllm_plugin.core.state import ProposerStats, RequestState
from specdec.vllm_plugin.core.user_options import CoreOptions
from specdec.vllm_plugin.internal import InternalSettings


class ProposerCore(ProposerReporting):
    """Turns vLLM's per-step rows into drafter calls and chain drafts (see the module docstring)."""

    def __init__(
        self,
        drafter: Drafter,
        options: CoreOptions,
        *,
        max_model_len: int,
        internal: InternalSettings | None = None,
        target_params: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``options``: the user's (``SpecdecOptions``, lane threads resolved); ``internal``: the internal settings
        (``EngineSettings.internal``; None: the defaults); ``target_params``: the served model's parameter count
        (``DraftingPolicy``'s padding estimate)."""
        self.options = options
        self.internal = InternalSettings() if internal is None else internal
        self.k = options.num_speculative_tokens
        self.max_model_len = max_model_len
        self.guard = DraftGuard(drafter, strict=options.strict)
        self.stats = ProposerStats()
        self.clock = clock
        # every drafting decision
        self.policy = DraftingPolicy(options, internal=self.internal, target_params=target_params)
        self.adaptive, self.backoff = self.policy.adaptive, self.policy.backoff  # (the policy's: read by the engines)
        self._last_t: float | None = None
        self._last_verified = 0
        self._last_running = 0  # rows with new tokens at the last step (its step-cost bucket)
        self.timeout_s = options.draft_timeout_ms / 1e3
        self._init_reporting()
        self.target_params = target_params
        self._lane_overruns = 0
        self._started_early: set[str] = set()  # started before their first step (threaded prepare): a prefill
        self.python = PythonEngine(self)  # any drafter; the fallback of the lane
        self.engine: StepEngine = self.python
        # the drafter's one-call step (native suffix), inline: only where deadlines may be checked after the fact
        lane = find_lane(drafter) if self.internal.native_step and self.internal.deadline_mode == "auto" else None
        if lane is not None:
            self.engine = LaneEngine(self, lane)
            if options.lane_threads > 1:  # 0 ("auto", resolved by the proposer) -> 1
                lane.lane_threads(options.lane_threads)  # rows of a step's drafting shared with helper threads

    @property
    def lane(self) -> Lane | None:
        """The drafter's native lane while the proposer drafts on it, else None (the Python engine)."""
        return self.engine.lane

    @property
    def requests(self) -> dict[str, RequestState]:
        """The Python engine's per-request records (empty while the lane drafts)."""
        return self.python.requests

    # ----------------------------------------------------------------- the step
    def step(self, batch: StepBatch, *, pad: bool | None = None) -> list[list[int]]:
        """One proposer call over ``batch`` (vLLM's arrays, read in place). ``pad``: pad every row to ``k`` (True)
        or not (False) whatever ``pad_drafts`` says (None: it decides)."""
        sampled = batch.sampled
        plan = self._begin(batch.req_ids, list(map(len, sampled)), batch.k, pad, tokens=sampled.__getitem__)
        self._stop_absent(plan.present)
        drafts = self.engine.draft_rows(batch, plan=plan)
        self.stats.propose_seconds += self.clock() - plan.t0
        return self._end(plan, drafts)

    def step_tokens(
        self,
        req_ids: Sequence[str],
        tokens: np.ndarray,
        new: Sequence[int],
        known: Sequence[int],
        fillers: Sequence[int],
        out: np.ndarray,
        *,
        context: Callable[[int], tuple[list[int], int]],
        k: int | None = None,
        pad: bool | None = None,
    ) -> list[int] | None:
        """``step`` for schedule mode's captured rows, through the lane's token-matrix call: ``tokens`` [>= rows, w]
        int32 (-1 = rejected), ``new`` [rows] their leading valid counts, ``known`` / ``fillers`` [rows] context
        lengths and last tokens before them, ``out`` [>= rows, width] int32: each row's padded draft is written
        there; returns the drafts' lengths. None: a step over the deadline, whose drafts are dropped (the caller
        pads ``out`` with no drafts). ``context(i)``: row i's context after its new tokens and its prompt length (a
        restart). Only with the lane (``self.lane``). Same drafts, statistics and decisions as ``step`` over the same
        rows."""
        assert self.lane is not None
        plan = self._begin(req_ids, new, k, pad, tokens=lambda i: tokens[i, : new[i]].tolist())
        self._stop_absent(plan.present)
        decisions = self.lane_decisions(plan)
        t0 = self.clock()
        lengths, counts = lane_step_tokens(
            self.lane, req_ids, tokens, known, fillers, out, context=context, decisions=decisions
        )
        self.count_lane(counts)
        dropped = self.lane_overrun(t0)
        if dropped:
            self.stats.propose_seconds += self.clock() - plan.t0
            self.on_timeout(sum(1 for m in lengths if m))
            self._end(plan, [], drafted=0, lengths=[])
            return None
        withheld = (
            0
            if plan.pad
            else self._forget(plan.ids, self.backoff.withhold_matrix(plan.ids, lengths, out, tokens, new, fillers))
        )
        self.stats.propose_seconds += self.clock() - plan.t0
        self._end(plan, [], drafted=counts.drafted - withheld, lengths=lengths)
        return lengths

    def _begin(
        self,
        req_ids: Sequence[str],
        lens: Sequence[int],
        k: int | None,
        pad: bool | None = None,
        *,
        tokens: Callable[[int], Sequence[int]],
    ) -> StepPlan:
        """A step's statistics, cost observations and decisions, before any drafter call. ``lens`` [rows]: each
        row's new token count, ``tokens(i)``: row i's new tokens."""
        t0 = self.clock()
        n_rows = len(lens)
        if len(req_ids) < n_rows:
            raise ValueError(f"{len(req_ids)} request ids for {n_rows} rows of sampled tokens")
        k = self.k if k is None else max(0, min(int(k), self.k))
        self.stats.steps += 1
        self.stats.rows += n_rows
        lens = list(lens)  # C-level loops below: ~64 rows
        emitted, running = sum(lens), n_rows - lens.count(0)
        self.stats.emitted_tokens += emitted
        known = self.engine.request_ids
        ids = list(req_ids[:n_rows])
        rows = set(ids)
        self.backoff.prune(rows)
        self.backoff.observe(ids, lens, tokens)
        early = self._started_early
        prefilled = running < n_rows or not known.keys() >= rows or not early.isdisjoint(rows)
        if early:  # keep those still prefilling (no token yet): their first token's step is a prefill step too
            self._started_early = {r for r, n in zip(req_ids, lens) if r in early and not n}
        if self._last_t is not None and not prefilled:
            last = self._last_running
            self.policy.observe_step(t0 - self._last_t, running=last, verified=self._last_verified, emitted=emitted)
        mode = "spec" if running else "plain"  # "plain": no decoding row, nothing to draft
        pad = self.policy.should_pad(running, k) if pad is None else pad
        return StepPlan(t0, n_rows, k, mode, running, rows, ids, pad)

    def _end(
        self,
        plan: StepPlan,
        drafts: list[list[int]],
        drafted: int | None = None,
        lengths: Sequence[int] | None = None,
    ) -> list[list[int]]:
        """Record what the step handed vLLM: ``drafts`` (back-off withholds some first), ``drafted``: their token
        count if known, ``lengths`` [rows]: their lengths where ``drafts`` does not hold them (schedule mode's
        matrix step)."""
        if lengths is None:
            withheld = 0 if plan.pad else self._forget(plan.ids, self.backoff.withhold(plan.ids, drafts))
            lengths = list(map(len, drafts))
            drafted = sum(lengths) if drafted is None else drafted - withheld
        elif drafted is None:
            drafted = sum(lengths)
        self.backoff.record(plan.ids, lengths)
        self._last_t, self._last_verified = plan.t0, plan.running + drafted
        self._last_running = plan.running
        self.stats.drafted_tokens += drafted
        self.stats.plain_steps += plan.mode == "plain"
        self.stats.drafted_steps += drafted > 0
        self._maybe_log()
        self._maybe_sample()
        return drafts

    def _forget(self, ids: Sequence[str], cut: Sequence[tuple[int, int]]) -> int:
        """The drafting engine forgets the drafts the back-off withheld (``cut``: (row, tokens) each; its calibration
        counts verified drafts only). Returns the tokens withheld."""
        if not cut:
            return 0
        self.engine.forget_drafts([ids[i] for i, _ in cut])
        return sum(n for _, n in cut)

    def note_verified(self, tokens: int) -> None:
        """The tokens the last step's verify batch really held (schedule mode: vLLM's reserved slots, not the
        drafts' lengths), for the step-cost fit."""
        if tokens > 0:
            self._last_verified = int(tokens)

    # ----------------------------------------------------------------- what the drafting engines ask (StepHost)
    def count_lane(self, counts: LaneCounts) -> None:
        self.stats.accepted_tokens += counts.accepted
        self.stats.started += counts.started
        self.stats.resyncs += counts.resyncs

    def lane_overrun(self, t0: float) -> bool:
        """Did the lane call begun at ``t0`` pass the deadline? (Its drafts are then dropped; after
        LANE_MAX_OVERRUNS of them the Python path takes over.)"""
        if not (self.timeout_s > 0 and self.clock() - t0 > self.timeout_s):
            return False
        self._lane_overruns += 1
        if self._lane_overruns >= LANE_MAX_OVERRUNS:
            self._leave_lane()
        return True

    def lane_decisions(self, plan: StepPlan) -> LaneDecisions:
        """The step's decisions for the lane's calls (the policy's)."""
        return self.policy.lane_decisions(plan, max_model_len=self.max_model_len)

    def cost_model(self, running: int) -> StepCostModel:
        """The step-cost fit of batches of ``running`` requests (the policy's)."""
        return self.policy.cost_model(running)

    def _leave_lane(self) -> None:
        """Back to the Python engine: the lane's requests stop (they restart from their context when next seen)."""
        lane, self.engine = self.engine, self.python
        self.python.ban_inline()
        if lane is not self.python:
            lane.stop_all()

    def reset(self) -> None:
        """Forget all per-request state (after a bookkeeping failure): every request restarts from its context."""
        self.engine.stop_all()

    def drafting_failed(self, exc: Exception, req_ids: list[str]) -> None:
        """A failed proposer step, in any mode: counted and logged by the guard (``draft_errors``, one line per
        error type), all drafter state forgotten (every request restarts from its full context); ``strict``
        re-raises instead."""
        if self.options.strict:
            raise exc
        self.guard.record_error(exc, req_ids)
        self.reset()

    def force_resync(self, request_id: str) -> None:
        """The request's next row restarts it from its full context (the caller is resending it)."""
        self.engine.invalidate(request_id)

    def _absent(self, present: set[str]) -> list[str]:
        """Requests the drafter holds that are not in this step's batch (in start order): to be stopped."""
        return [r for r in self.engine.request_ids if r not in present]

    def needs_start(self, request_id: str) -> bool:
        """True if ``start_early`` would start the request (the native lane is there and does not hold it)."""
        return self.lane is not None and request_id not in self.engine.request_ids

    def start_early(self, request_id: str, prompt_ids: Sequence[int], rest_ids: Sequence[int]) -> bool:
        """Start a request the native lane does not hold from its context (its next row then extends it by its new
        tokens): schedule mode's device wait does it while the GPU still runs the previous step, instead of the
        step restarting the row from its context. Same drafts. False (nothing done) without the lane or if the
        request is already held."""
        if not self.engine.start_early(request_id, prompt_ids, rest_ids):
            return False
        self.note_started_early([request_id])
        return True

    def refresh_early(self) -> int:
        """Rebuild now the global-cache match fronts that the stops made stale (the next ``step`` would rebuild them
        while drafting): schedule mode's device wait does it while the GPU still runs the previous step. Same drafts.
        Returns the requests refreshed (0 without the lane)."""
        n = self.engine.refresh_early()
        self.stats.early_refreshes += n
        return n

    def note_started_early(self, request_ids: Sequence[str]) -> None:
        """Requests started before their first step (``start_early``, thread mode's ``prepare``): counted, and their
        first step, a prefill step, kept out of the step-cost fit (``_begin``)."""
        self.stats.started += len(request_ids)
        self._started_early.update(request_ids)

    def stop_absent(self, present: Iterable[str]) -> None:
        """Stop now the requests the next ``step`` would stop first (those not in ``present``, its request ids):
        schedule mode's device wait does it while the GPU still runs the previous step. Same drafts."""
        self._stop_absent(set(present))

    def _stop_absent(self, present: set[str]) -> None:
        for rid in self._absent(present):
            self.engine.stop(rid)
            self.stats.stopped += 1

    def token_cost(self, running: int) -> float:
        """The calibrated acceptance probability a verified draft token needs at ``running`` decoding rows (the
        policy's; 0 with the adaptive controller off)."""
        return self.policy.token_cost(running)

    _chain = staticmethod(chain_draft)  # (tests and benchmarks cut chains as a step does)

    def close(self) -> None:
        self.log_final()
        self.engine.close()
        if self.engine is not self.python:
            self.python.close()
        self.guard.drafter.close()
