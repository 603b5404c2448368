"""Per-request bookkeeping of the vLLM proposer, free of vLLM (CPU-tested with fake vLLM-shaped inputs).

Each step vLLM hands the proposer, row by row of its input batch, the tokens the verifier just emitted
(``sampled_token_ids[i]``: accepted draft tokens + the bonus token; empty for partial prefills), the row's
context length after them (``num_tokens_no_spec[i]``) and the context itself (``token_ids_cpu[i, :n]``).
Rows move between steps, so state is keyed by vLLM's request id (``req_ids[i]``, from the runner's input batch).

``ProposerCore.step`` turns that into drafter lifecycle calls (start / extend / stop, keyed by request id),
a batched ``draft_batch`` under a deadline, and chain drafts that never exceed ``num_speculative_tokens`` nor
reach past ``max_model_len``. A request seen with a context length that does not follow from what the drafter
knows (preemption, recompute) is restarted from the full context ("resync"). Requests absent from the batch are
stopped (finished, aborted or preempted; a preempted one is restarted when it returns).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import numpy as np

from specdec.drafters.base import Chain, Drafter, DraftGuard, DraftRequest
from specdec.vllm_plugin.core.adaptive import AdaptiveController, StepCostModel, bucket_of, update_acceptance
from specdec.vllm_plugin.core.lane import CALIB_DECAY, Lane, LaneCounts, find_lane, lane_step, lane_step_tokens
from specdec.vllm_plugin.logs import LOGGER_NAME
from specdec.vllm_plugin.core.state import Order, ProposerStats, RequestState  # noqa: F401 - RequestState re-exported
from specdec.vllm_plugin.entry.options import SpecdecOptions
from specdec.vllm_plugin.core.worker import DraftWorker

logger = logging.getLogger(LOGGER_NAME)

MAX_PENDING_OPS = 8192  # queued drafter updates applied even without drafting
AUTO_PROBE_JOBS = 64  # deadline_mode "auto": threaded drafting jobs observed before going inline
AUTO_INLINE_FRACTION = 0.25  # ... if all of them but AUTO_SLOW_JOBS_TOLERATED took less than this fraction
AUTO_SLOW_JOBS_TOLERATED = 1  # of the deadline (one scheduling hiccup is not a slow drafter)
ASSUMED_GPU_FLOPS = 1e15  # dense bf16 of an H100/H200 class GPU, for pad_drafts="auto"'s compute estimate
PAD_MAX_STEP_SHARE = 0.1  # pad_drafts="auto": pad while the padded tokens' compute is under this share of a step
PAD_DEFAULT_PERIOD_S = 1e-3  # step period assumed before any is measured
PERIOD_EMA = 0.9  # decay of the step-period average
LANE_MAX_OVERRUNS = 3  # native-step calls over the deadline before the proposer falls back to the Python path
Op = tuple  # ("start", rid, prompt) | ("extend", rid, tokens) | ("stop", rid)


class StepPlan(NamedTuple):
    """One step's decisions, taken before drafting (``ProposerCore._begin``)."""

    t0: float  # clock at the step's start
    rows: int
    k: int  # draft length limit this step
    mode: str  # "spec" or "plain"
    running: int  # rows with new tokens
    present: set[str]  # the step's request ids (those the drafter holds beyond them are stopped)


class ProposerCore:
    """Turns vLLM's per-step rows into drafter calls and chain drafts (see the module docstring)."""

    def __init__(self, drafter: Drafter, options: SpecdecOptions, *, max_model_len: int,
                 target_params: float = 0.0, clock: Callable[[], float] = time.perf_counter) -> None:
        """``target_params``: the served model's parameter count (pad_drafts="auto" estimates the compute of
        padded tokens as 2 x params FLOPs each; 0 = unknown, then "auto" never pads)."""
        self.options = options
        self.k = options.num_speculative_tokens
        self.max_model_len = max_model_len
        self.guard = DraftGuard(drafter, strict=options.strict)
        self.requests: dict[str, RequestState] = {}
        self.stats = ProposerStats()
        self.clock = clock
        self.adaptive = AdaptiveController(
            enabled=options.adaptive, min_path_prob=options.min_path_prob,
            min_path_prob_per_seq=options.min_path_prob_per_seq, min_acceptance=options.min_acceptance)
        self.costs: dict[int, StepCostModel] = {}  # one step-cost fit per batch-size bucket
        self._last_t: float | None = None
        self._last_verified = 0
        self._last_bucket = 0
        self.timeout_s = options.draft_timeout_ms / 1e3
        self.worker = DraftWorker() if self.timeout_s > 0 else None
        self._pending: list[Op] = []  # drafter lifecycle ops not yet applied, in order
        self._pending_ext: dict[str, int] = {}  # request id -> index of its trailing extend op in _pending
        self._timeout_logged = False
        self._inline_ok = self._inline_banned = False
        self._job_count, self._max_job_s, self._slow_jobs = 0, 0.0, 0
        self._last_log = clock()
        self.target_params = target_params
        self._token_s = 2.0 * target_params / ASSUMED_GPU_FLOPS  # GPU seconds per verified token (estimate)
        self._period_s = PAD_DEFAULT_PERIOD_S
        self._pad_now = False
        self.pad_below_rows = 0  # pad_drafts="auto" also pads below this many running requests (schedule mode)
        # the drafter's one-call step (native suffix), inline: only where deadlines may be checked after the fact
        self.lane: Lane | None = None
        self._lane_overruns = 0
        self._started_early: set[str] = set()  # started before their first step (threaded prepare): a prefill
        if options.native_step and options.deadline_mode == "auto":
            self.lane = find_lane(drafter)
        if self.lane is not None and options.lane_threads > 1:  # 0 ("auto", resolved by the proposer) -> 1
            self.lane.lane_threads(options.lane_threads)  # rows of a step's drafting shared with helper threads

    # ----------------------------------------------------------------- the step
    def step(self, req_ids: Sequence[str], sampled_token_ids: Sequence[Sequence[int]],
             num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray, *,
             num_prompt_tokens: np.ndarray | None = None, k: int | None = None,
             pad: bool | None = None) -> list[list[int]]:
        """One proposer call. Arrays are vLLM's: ``num_tokens_no_spec`` [max_num_reqs] int32,
        ``token_ids_cpu`` [max_num_reqs, max_model_len] int32, ``num_prompt_tokens`` [max_num_reqs].
        ``pad``: pad every row to ``k`` (True) or not (False) whatever ``pad_drafts`` says (None: it decides)."""
        plan = self._begin(req_ids, list(map(len, sampled_token_ids)), k, pad)
        self._stop_absent(plan.present)
        if self.lane is not None:
            drafts = self._step_lane(req_ids, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                                     num_prompt_tokens, k=plan.k, mode=plan.mode, running=plan.running)
        else:
            drafts = self._step_rows(req_ids, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                                     num_prompt_tokens, k=plan.k, mode=plan.mode, running=plan.running)
        self.stats.propose_seconds += self.clock() - plan.t0
        return self._end(plan, drafts)

    def step_tokens(self, req_ids: Sequence[str], tokens: np.ndarray, new: Sequence[int], known: Sequence[int],
                    fillers: Sequence[int], out: np.ndarray, *, context: Callable[[int], tuple[list[int], int]],
                    k: int | None = None, pad: bool | None = None) -> list[int] | None:
        """``step`` for schedule mode's captured rows, through the lane's token-matrix call: ``tokens`` [>= rows, w]
        int32 (-1 = rejected), ``new`` [rows] their leading valid counts, ``known`` / ``fillers`` [rows] context
        lengths and last tokens before them, ``out`` [>= rows, width] int32: each row's padded draft is written
        there; returns the drafts' lengths. None: a step over the deadline, whose drafts are dropped (the caller
        pads ``out`` with no drafts). ``context(i)``: row i's context after its new tokens and its prompt length (a
        restart). Only with the lane (``self.lane``). Same drafts, statistics and decisions as ``step`` over the same
        rows."""
        assert self.lane is not None
        plan = self._begin(req_ids, new, k, pad)
        self._stop_absent(plan.present)
        decisions = self._lane_decisions(k=plan.k, mode=plan.mode, running=plan.running)
        t0 = self.clock()
        lengths, counts = lane_step_tokens(self.lane, req_ids, tokens, known, fillers, out, context=context,
                                           decisions=decisions)
        self._count_lane(counts)
        dropped = self._lane_overrun(t0)
        self.stats.propose_seconds += self.clock() - plan.t0
        if dropped:
            self._on_timeout(sum(1 for m in lengths if m))
            self._end(plan, [], drafted=0)
            return None
        self._end(plan, [], drafted=counts.drafted)
        return lengths

    def _begin(self, req_ids: Sequence[str], lens: Sequence[int], k: int | None, pad: bool | None = None) -> StepPlan:
        """A step's statistics, cost observations and decisions, before any drafter call. ``lens`` [rows]: each
        row's new tokens."""
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
        known = self.lane.request_ids if self.lane is not None else self.requests
        rows = set(req_ids[:n_rows])
        early = self._started_early
        prefilled = running < n_rows or not known.keys() >= rows or not early.isdisjoint(rows)
        if early:  # keep those still prefilling (no token yet): their first token's step is a prefill step too
            self._started_early = {r for r, n in zip(req_ids, lens) if r in early and not n}
        if self._last_t is not None and not prefilled:
            self._cost(self._last_bucket).observe(t0 - self._last_t, self._last_verified, emitted)
            self._period_s = PERIOD_EMA * self._period_s + (1 - PERIOD_EMA) * (t0 - self._last_t)
        mode = "spec" if running else "plain"  # "plain": no decoding row, nothing to draft
        self._pad_now = self._should_pad(running, k) if pad is None else pad
        return StepPlan(t0, n_rows, k, mode, running, rows)

    def _end(self, plan: StepPlan, drafts: list[list[int]], drafted: int | None = None) -> list[list[int]]:
        """Record what the step handed vLLM (``drafted``: their token count, if known)."""
        if drafted is None:
            drafted = sum(map(len, drafts))
        self._last_t, self._last_verified = plan.t0, plan.running + drafted
        self._last_bucket = bucket_of(plan.running)
        self.stats.drafted_tokens += drafted
        self.stats.plain_steps += plan.mode == "plain"
        self._maybe_log()
        return drafts

    def note_verified(self, tokens: int) -> None:
        """The tokens the last step's verify batch really held (schedule mode: vLLM's reserved slots, not the
        drafts' lengths), for the step-cost fit."""
        if tokens > 0:
            self._last_verified = int(tokens)

    def _step_rows(self, req_ids: Sequence[str], sampled_token_ids: Sequence[Sequence[int]],
                   num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray, num_prompt_tokens: np.ndarray | None,
                   *, k: int, mode: str, running: int) -> list[list[int]]:
        """The Python path: one ``Order`` per row, a batched drafter job (maybe threaded), cut and pad."""
        orders: list[Order | None] = [self._row(i, req_ids[i], sampled_token_ids[i], int(num_tokens_no_spec[i]),
                                                token_ids_cpu, num_prompt_tokens, k, mode)
                                      for i in range(len(sampled_token_ids))]
        drafts, preds, reals = self._draft(orders, running)
        for i, d in enumerate(drafts):
            st = self.requests.get(req_ids[i])
            if st is not None:
                st.last_draft, st.last_pred, st.last_real = len(d), preds[i], reals[i]
        return drafts

    def _step_lane(self, req_ids: Sequence[str], sampled_token_ids: Sequence[Sequence[int]],
                   num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray, num_prompt_tokens: np.ndarray | None,
                   *, k: int, mode: str, running: int) -> list[list[int]]:
        """The one-call path (``lane.py``): same drafts as ``_step_rows``. A step over the deadline is dropped
        (counted); after LANE_MAX_OVERRUNS of them the Python path (threaded, deadline-checked) takes over."""
        assert self.lane is not None
        decisions = self._lane_decisions(k=k, mode=mode, running=running)
        t0 = self.clock()
        drafts, counts = lane_step(self.lane, req_ids, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                                   num_prompt_tokens=num_prompt_tokens, decisions=decisions)
        self._count_lane(counts)
        if self._lane_overrun(t0):
            self._on_timeout(sum(1 for d in drafts if d))
            return [[] for _ in drafts]
        return drafts

    def _count_lane(self, counts: LaneCounts) -> None:
        self.stats.accepted_tokens += counts.accepted
        self.stats.started += counts.started
        self.stats.resyncs += counts.resyncs

    def _lane_overrun(self, t0: float) -> bool:
        """Did the lane call begun at ``t0`` pass the deadline? (Its drafts are then dropped; after
        LANE_MAX_OVERRUNS of them the Python path takes over.)"""
        if not (self.timeout_s > 0 and self.clock() - t0 > self.timeout_s):
            return False
        self._lane_overruns += 1
        if self._lane_overruns >= LANE_MAX_OVERRUNS:
            self._leave_lane()
        return True

    def _lane_decisions(self, *, k: int, mode: str, running: int) -> dict[str, Any]:
        """The keyword arguments of ``Lane.lane_step`` besides the rows."""
        enabled = self.adaptive.enabled
        value = self._cost(bucket_of(running)).token_cost() if enabled else 0.0
        return {"k": k, "max_model_len": self.max_model_len, "spec": mode != "plain", "pad": self._pad_now,
                "adaptive": enabled, "min_acceptance": self.adaptive.min_acceptance,
                "floor": self.adaptive.cut(running) if enabled else self.adaptive.min_path_prob, "value": value}

    def _leave_lane(self) -> None:
        """Back to the Python path: the lane's requests stop (they restart from their context when next seen)."""
        lane, self.lane = self.lane, None
        self._inline_banned = True
        if lane is not None:
            _stop_all(lane)

    def reset(self) -> None:
        """Forget all per-request state (after a bookkeeping failure): every request restarts from its context."""
        for rid in self.requests:
            self._op(("stop", rid))
        self.requests.clear()
        if self.lane is not None:
            _stop_all(self.lane)

    def force_resync(self, request_id: str) -> None:
        """The request's next row restarts it from its full context (the caller is resending it)."""
        st = self.requests.get(request_id)
        if st is not None:
            st.n_known = -1
        if self.lane is not None:
            self.lane.lane_invalidate(request_id)

    def _row(self, i: int, rid: str, sampled: Sequence[int], n: int, token_ids_cpu: np.ndarray,
             num_prompt_tokens: np.ndarray | None, k: int, mode: str) -> Order | None:
        if not sampled:  # partial prefill or a discarded row: no new tokens, no draft
            return None
        st = self.requests.get(rid)
        if st is not None and st.n_known + len(sampled) == n:
            self._extend(rid, sampled)
            accepted = min(len(sampled) - 1, st.last_draft)
            self.stats.accepted_tokens += accepted
            real = min(accepted, st.last_real)  # calibration and acceptance: the drafter's own tokens only
            if st.last_pred is not None:
                st.pred_ema = CALIB_DECAY * st.pred_ema + st.last_pred
                st.acc_ema = CALIB_DECAY * st.acc_ema + real
            st.acceptance_ema = update_acceptance(st.acceptance_ema, st.last_real, real)
            st.n_known = n
        else:
            if st is not None:
                self.stats.resyncs += 1
                self._op(("stop", rid))
            p = n - len(sampled)
            if num_prompt_tokens is not None:
                p = max(1, min(int(num_prompt_tokens[i]), n))
            ctx = np.asarray(token_ids_cpu[i, :n]).tolist()  # copy: the row's buffer changes later
            self._op(("start", rid, ctx[:p]))
            if n > p:
                self._extend(rid, ctx[p:])
            self.requests.pop(rid, None)  # re-inserted: same order as the drafter's (stops follow it)
            st = self.requests[rid] = RequestState(n_known=n)
            self.stats.started += 1
        room = min(k, self.max_model_len - n - 1)
        budget = self.adaptive.request_budget(room, st.acceptance_ema)
        if mode == "plain" or budget <= 0:
            return None
        pad = room if self._pad_now else 0  # uniform batches: every row submits exactly `room`
        return Order(DraftRequest(rid, max(budget, pad), tree=False, free=pad > 0), budget, pad, int(sampled[-1]))

    def _should_pad(self, running: int, k: int) -> bool:
        """Pad this step's drafts to k? 'on'/'off' decide; 'auto' pads while the verify batch of running x (k+1)
        tokens costs (estimated GPU compute) under PAD_MAX_STEP_SHARE of the measured step period."""
        mode = self.options.pad_mode
        if mode != "auto":
            return mode == "on"
        if running < self.pad_below_rows:
            return True
        return 0 < running * (k + 1) * self._token_s <= PAD_MAX_STEP_SHARE * self._period_s

    def _absent(self, present: set[str]) -> list[str]:
        """Requests the drafter holds that are not in this step's batch (in start order): to be stopped."""
        known = self.lane.request_ids if self.lane is not None else self.requests
        return [r for r in known if r not in present]

    def needs_start(self, request_id: str) -> bool:
        """True if ``start_early`` would start the request (the native lane is there and does not hold it)."""
        return self.lane is not None and request_id not in self.lane.request_ids

    def start_early(self, request_id: str, prompt_ids: Sequence[int], rest_ids: Sequence[int]) -> bool:
        """Start a request the native lane does not hold from its context (its next row then extends it by its new
        tokens): schedule mode's device wait does it while the GPU still runs the previous step, instead of the
        step restarting the row from its context. Same drafts. False (nothing done) without the lane or if the
        request is already held."""
        if self.lane is None or request_id in self.lane.request_ids:
            return False
        self.lane.lane_start(request_id, prompt_ids, rest_ids)
        self.note_started_early([request_id])
        return True

    def refresh_early(self) -> int:
        """Rebuild now the global-cache match fronts that the stops made stale (the next ``step`` would rebuild them
        while drafting): schedule mode's device wait does it while the GPU still runs the previous step. Same drafts.
        Returns the requests refreshed (0 without the lane)."""
        if self.lane is None:
            return 0
        n = self.lane.lane_refresh()
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
        if self.lane is not None:
            for rid in self._absent(present):
                self.lane.stop(rid)
                self.stats.stopped += 1
            return
        for rid in self._absent(present):
            del self.requests[rid]
            self._op(("stop", rid))
            self.stats.stopped += 1

    def _op(self, op: Op) -> None:
        self._pending_ext.pop(op[1], None)
        self._pending.append(op)

    def _extend(self, rid: str, tokens: Sequence[int]) -> None:
        """Queue an extend, merged into the request's pending one (steps without drafting apply nothing)."""
        at = self._pending_ext.get(rid)
        if at is not None:
            self._pending[at][2].extend(tokens)
        else:
            self._pending_ext[rid] = len(self._pending)
            self._pending.append(("extend", rid, list(tokens)))

    # ----------------------------------------------------------------- drafting
    def _draft(self, orders: list[Order | None],
               running: int) -> tuple[list[list[int]], list[float | None], list[int]]:
        """(drafts, their predicted accepted tokens or None, the drafter's own token count) per row."""
        wanted = [o.request for o in orders if o is not None]
        if not wanted and len(self._pending) < MAX_PENDING_OPS:  # no drafts this step: updates wait, merged
            return self._nothing(orders)
        ops, self._pending, self._pending_ext = self._pending, [], {}
        job = lambda: self._job(ops, wanted)  # noqa: E731
        if self.worker is None:
            chains = job()
        elif self.worker.busy:
            self._pending = ops + self._pending  # applied, in order, by the next job
            self.stats.busy_skips += 1
            return self._nothing(orders)
        elif not wanted:  # too many queued updates: apply them (fast) inline
            chains = job()
        elif self._inline_ok:  # auto mode, drafter proven fast: no thread hand-off
            t0 = self.clock()
            chains = job()
            if self.clock() - t0 > self.timeout_s:  # overran: drop the drafts, enforce deadlines from now on
                self._inline_ok, self._inline_banned = False, True
                self._on_timeout(len(wanted))
                return self._nothing(orders)
        else:
            t0 = self.clock()
            finished, chains = self.worker.run(job, timeout_s=self.timeout_s)
            if not finished:
                self._inline_banned = True
                self._on_timeout(len(wanted))
                return self._nothing(orders)
            self._note_job(self.clock() - t0)
        cost = self._cost(bucket_of(running))
        value = cost.token_cost() if self.adaptive.enabled else 0.0  # calibrated prob a token must reach
        it = iter(chains or [])
        out = []
        for o in orders:
            if o is None:
                out.append(([], None, 0))
                continue
            st = self.requests.get(o.request.request_id)
            cut = self.adaptive.cut(running, value / st.calibration() if st is not None and value else value)
            tokens, probs = next(it)
            out.append(self._chain(tokens, probs, o.budget, cut, pad=o.pad, filler=o.filler))
        return [c[0] for c in out], [c[1] for c in out], [c[2] for c in out]

    @staticmethod
    def _nothing(orders: list) -> tuple[list[list[int]], list[float | None], list[int]]:
        return [[] for _ in orders], [None for _ in orders], [0 for _ in orders]

    def token_cost(self, running: int) -> float:
        """The calibrated acceptance probability a verified draft token needs at ``running`` decoding rows (the
        step-cost fit's; 0 with the adaptive controller off)."""
        return self._cost(bucket_of(running)).token_cost() if self.adaptive.enabled else 0.0

    def _cost(self, bucket: int) -> StepCostModel:
        cost = self.costs.get(bucket)
        if cost is None:
            cost = self.costs[bucket] = StepCostModel()
        return cost

    def flush(self) -> None:
        """Apply queued drafter updates now (they otherwise wait for the next drafting step)."""
        if self._pending and (self.worker is None or not self.worker.busy):
            ops, self._pending, self._pending_ext = self._pending, [], {}
            self._job(ops, [])

    def _note_job(self, seconds: float) -> None:
        """auto mode: after AUTO_PROBE_JOBS threaded jobs all under a quarter of the deadline, go inline."""
        self._job_count += 1
        self._max_job_s = max(self._max_job_s, seconds)
        self._slow_jobs += seconds >= AUTO_INLINE_FRACTION * self.timeout_s
        if (self.options.deadline_mode == "auto" and not self._inline_banned and self._job_count >= AUTO_PROBE_JOBS
                and self._slow_jobs <= AUTO_SLOW_JOBS_TOLERATED):
            self._inline_ok = True

    def _job(self, ops: list[Op], wanted: list[DraftRequest]) -> list[Chain]:
        for op in ops:
            self.guard.call(op[0], *op[1:])
        return self.guard.draft_chains(wanted) if wanted else []

    @staticmethod
    def _chain(tokens: list[int], probs: list[float] | None, budget: int, cut: float, *, pad: int = 0,
               filler: int = 0) -> tuple[list[int], float | None, int]:
        """(chain tokens to submit, sum of the drafter's own tokens' path probabilities or None, their count).

        The drafter's own tokens stop at ``budget`` and at the first path probability below ``cut``. With
        ``pad`` > 0 the submitted chain is exactly ``pad`` tokens long: the drafter's chain past the cut, then
        ``filler`` (the request's last token) repeated. Padding never changes what is emitted (the verifier
        decides); it only makes every row the same length.
        """
        m = min(len(tokens), budget)
        if probs is not None and cut > 0:
            m = next((j for j in range(m) if probs[j] < cut), m)
        pred = sum(probs[:m]) if probs is not None else None
        if pad <= 0:
            return tokens[:m], pred, m
        chain = tokens[:pad]
        chain += [chain[-1] if chain else filler] * (pad - len(chain))
        return chain, pred, m

    def _on_timeout(self, n: int) -> None:
        self.stats.timeouts += 1
        self.guard.stats.timeouts += 1
        if not self._timeout_logged:
            self._timeout_logged = True
            logger.warning("specdec: drafting %d request(s) took longer than draft_timeout_ms=%.1f; that step goes "
                           "on without drafts (counted as draft_timeouts; not logged again)",
                           n, self.options.draft_timeout_ms)

    # ----------------------------------------------------------------- reporting
    def stats_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = self.stats.as_dict()
        d.update(self.guard.stats.as_dict())
        d["draft_timeouts"] = self.stats.timeouts
        d["active_requests"] = len(self.lane.request_ids) if self.lane is not None else len(self.requests)
        d["native_step"] = self.lane is not None
        d["cost_model"] = {str(b): c.as_dict() for b, c in sorted(self.costs.items())}
        d["inline_drafting"] = self._inline_ok
        d["pad_token_us"] = 1e6 * self._token_s
        d["step_period_ms"] = 1e3 * self._period_s
        d["max_threaded_job_ms"] = 1e3 * self._max_job_s
        return d

    def _maybe_log(self) -> None:
        every = self.options.log_every_s
        now = self.clock()
        if every > 0 and now - self._last_log >= every:
            self._last_log = now
            s = self.stats
            logger.info("specdec: %d steps, drafted %d, accepted %d (%.1f%%), %.3f ms/step in propose, "
                        "%d timeouts, %d errors, %d plain steps", s.steps, s.drafted_tokens, s.accepted_tokens,
                        100 * s.accepted_tokens / max(s.drafted_tokens, 1), 1e3 * s.propose_seconds / s.steps,
                        s.timeouts, self.guard.stats.errors, s.plain_steps)

    def close(self) -> None:
        for rid in list(self.requests):
            self._pending.append(("stop", rid))
        self.requests.clear()
        if self.lane is not None:
            _stop_all(self.lane)
        if self.worker is not None:
            self.worker.close()
        self.guard.drafter.close()


def _stop_all(lane: Lane) -> None:
    """Stop every request the lane's drafter holds (they restart from their context if seen again)."""
    for rid in list(lane.request_ids):
        lane.stop(rid)
