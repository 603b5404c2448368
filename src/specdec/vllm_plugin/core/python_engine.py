"""``PythonEngine``: the ``StepEngine`` for any drafter (``engine.py``), in Python.

Per row it keeps a ``RequestState`` (context length known, last draft, calibration and acceptance sums), queues the
drafter's lifecycle calls (start / extend / stop, merged while no step drafts) and hands each drafting step one
batched drafter job: inline, or on the deadline thread (``DraftWorker``) where ``draft_timeout_ms`` applies. With
``deadline_mode="auto"`` a drafter that proves fast (``AUTO_PROBE_JOBS`` jobs under a quarter of the deadline) runs
inline; one overrun sends it back to the thread for good. Each chain is cut at the drafter's budget and at the
first path probability under the step's cut, then padded where the step pads.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from specdec.drafters.base import Chain, DraftRequest
from specdec.vllm_plugin.core.batch import StepBatch
from specdec.vllm_plugin.core.engine import StepHost, StepPlan
from specdec.vllm_plugin.core.lane import CALIB_DECAY
from specdec.vllm_plugin.core.state import Order, RequestState
from specdec.vllm_plugin.core.worker import DraftWorker

MAX_PENDING_OPS = 8192  # queued drafter updates applied even without drafting
AUTO_PROBE_JOBS = 64  # deadline_mode "auto": threaded drafting jobs observed before going inline
AUTO_INLINE_FRACTION = 0.25  # ... if all of them but AUTO_SLOW_JOBS_TOLERATED took less than this fraction
AUTO_SLOW_JOBS_TOLERATED = 1  # of the deadline (one scheduling hiccup is not a slow drafter)
Op = tuple  # ("start", rid, prompt) | ("extend", rid, tokens) | ("stop", rid)
Drafted = tuple[list[list[int]], list[float | None], list[int]]  # drafts, predicted accepted tokens, own tokens


class PythonEngine:
    """``StepEngine`` in Python (see the module docstring). ``core``: the ``ProposerCore`` that owns it (its
    options, statistics, adaptive controller, cost fit, drafter guard, clock and deadline)."""

    lane = None  # no native lane

    def __init__(self, core: StepHost) -> None:
        self.core = core
        self.requests: dict[str, RequestState] = {}
        self.worker = DraftWorker() if core.timeout_s > 0 else None
        self._pending: list[Op] = []  # drafter lifecycle ops not yet applied, in order
        self._pending_ext: dict[str, int] = {}  # request id -> index of its trailing extend op in _pending
        self.inline_ok = self.inline_banned = False
        self._job_count, self.max_job_s, self._slow_jobs = 0, 0.0, 0

    @property
    def request_ids(self) -> Collection[str]:
        return self.requests

    def draft_rows(self, batch: StepBatch, *, plan: StepPlan) -> list[list[int]]:
        """One ``Order`` per row, a batched drafter job (maybe threaded), cut and pad."""
        orders = [self._row(batch, i, plan) for i in range(batch.rows)]
        drafts, preds, reals = self._draft(orders, plan.running)
        for i, d in enumerate(drafts):
            st = self.requests.get(batch.req_ids[i])
            if st is not None:
                st.last_draft, st.last_pred, st.last_real = len(d), preds[i], reals[i]
        return drafts

    def stop(self, request_id: str) -> None:
        del self.requests[request_id]
        self._op(("stop", request_id))

    def stop_all(self) -> None:
        for rid in self.requests:
            self._op(("stop", rid))
        self.requests.clear()

    def forget_drafts(self, request_ids: Sequence[str]) -> None:
        """These requests' drafts of the last step were withheld (the back-off): nothing of them is verified, so
        their calibration does not count them."""
        for rid in request_ids:
            st = self.requests.get(rid)
            if st is not None:
                st.last_draft = st.last_real = 0
                st.last_pred = None

    def invalidate(self, request_id: str) -> None:
        st = self.requests.get(request_id)
        if st is not None:
            st.n_known = -1

    def start_early(self, request_id: str, prompt_ids: Sequence[int], rest_ids: Sequence[int]) -> bool:
        return False  # a request starts at its first row (its context from vLLM's buffer)

    def refresh_early(self) -> int:
        return 0  # nothing goes stale between steps

    def close(self) -> None:
        for rid in list(self.requests):
            self._pending.append(("stop", rid))
        self.requests.clear()
        if self.worker is not None:
            self.worker.close()

    def ban_inline(self) -> None:
        """Every drafting job from now on runs on the deadline thread (the drafter overran a deadline)."""
        self.inline_banned = True

    def flush(self) -> None:
        """Apply queued drafter updates now (they otherwise wait for the next drafting step)."""
        if self._pending and (self.worker is None or not self.worker.busy):
            ops, self._pending, self._pending_ext = self._pending, [], {}
            self._job(ops, [])

    # ----------------------------------------------------------------- rows
    def _row(self, batch: StepBatch, i: int, plan: StepPlan) -> Order | None:
        rid, sampled, n = batch.req_ids[i], batch.sampled[i], int(batch.num_tokens[i])
        if not sampled:  # partial prefill or a discarded row: no new tokens, no draft
            return None
        stats = self.core.stats
        st = self.requests.get(rid)
        if st is not None and st.n_known + len(sampled) == n:
            self._extend(rid, sampled)
            accepted = min(len(sampled) - 1, st.last_draft)
            stats.accepted_tokens += accepted
            real = min(accepted, st.last_real)  # calibration: the drafter's own tokens only
            if st.last_pred is not None:
                st.pred_ema = CALIB_DECAY * st.pred_ema + st.last_pred
                st.acc_ema = CALIB_DECAY * st.acc_ema + real
            st.n_known = n
        else:
            if st is not None:
                stats.resyncs += 1
                self._op(("stop", rid))
            ctx, p = batch.context(i)  # a copy: the row's buffer changes later
            self._op(("start", rid, ctx[:p]))
            if n > p:
                self._extend(rid, ctx[p:])
            self.requests.pop(rid, None)  # re-inserted: same order as the drafter's (stops follow it)
            st = self.requests[rid] = RequestState(n_known=n)
            stats.started += 1
        room = min(plan.k, self.core.max_model_len - n - 1)
        if plan.mode == "plain" or room <= 0:
            return None
        pad = room if plan.pad else 0  # uniform batches: every row submits exactly `room`
        return Order(DraftRequest(rid, room, tree=False, free=pad > 0), room, pad, int(sampled[-1]))

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
    def _draft(self, orders: list[Order | None], running: int) -> Drafted:
        """(drafts, their predicted accepted tokens or None, the drafter's own token count) per row."""
        core = self.core
        wanted = [o.request for o in orders if o is not None]
        if not wanted and len(self._pending) < MAX_PENDING_OPS:  # no drafts this step: updates wait, merged
            return _nothing(orders)
        ops, self._pending, self._pending_ext = self._pending, [], {}
        job = lambda: self._job(ops, wanted)  # noqa: E731
        if self.worker is None:
            chains = job()
        elif self.worker.busy:
            self._pending = ops + self._pending  # applied, in order, by the next job
            core.stats.busy_skips += 1
            return _nothing(orders)
        elif not wanted:  # too many queued updates: apply them (fast) inline
            chains = job()
        elif self.inline_ok:  # auto mode, drafter proven fast: no thread hand-off
            t0 = core.clock()
            chains = job()
            if core.clock() - t0 > core.timeout_s:  # overran: drop the drafts, enforce deadlines from now on
                self.inline_ok, self.inline_banned = False, True
                core.on_timeout(len(wanted))
                return _nothing(orders)
        else:
            t0 = core.clock()
            finished, chains = self.worker.run(job, timeout_s=core.timeout_s)
            if not finished:
                self.inline_banned = True
                core.on_timeout(len(wanted))
                return _nothing(orders)
            self._note_job(core.clock() - t0)
        cost = core.cost_model(running)
        value = cost.token_cost() if core.adaptive.enabled else 0.0  # calibrated prob a token must reach
        it = iter(chains or [])
        out = []
        for o in orders:
            if o is None:
                out.append(([], None, 0))
                continue
            st = self.requests.get(o.request.request_id)
            cut = core.adaptive.cut(running, value / st.calibration() if st is not None and value else value)
            tokens, probs = next(it)
            out.append(chain_draft(tokens, probs, o.budget, cut, pad=o.pad, filler=o.filler))
        return [c[0] for c in out], [c[1] for c in out], [c[2] for c in out]

    def _note_job(self, seconds: float) -> None:
        """auto mode: after AUTO_PROBE_JOBS threaded jobs all under a quarter of the deadline, go inline."""
        self._job_count += 1
        self.max_job_s = max(self.max_job_s, seconds)
        self._slow_jobs += seconds >= AUTO_INLINE_FRACTION * self.core.timeout_s
        if (
            self.core.internal.deadline_mode == "auto"
            and not self.inline_banned
            and self._job_count >= AUTO_PROBE_JOBS
            and self._slow_jobs <= AUTO_SLOW_JOBS_TOLERATED
        ):
            self.inline_ok = True

    def _job(self, ops: list[Op], wanted: list[DraftRequest]) -> list[Chain]:
        guard = self.core.guard
        for op in ops:
            guard.call(op[0], *op[1:])
        return guard.draft_chains(wanted) if wanted else []


def _nothing(orders: list) -> Drafted:
    return [[] for _ in orders], [None for _ in orders], [0 for _ in orders]


def chain_draft(
    tokens: list[int], probs: list[float] | None, budget: int, cut: float, *, pad: int = 0, filler: int = 0
) -> tuple[list[int], float | None, int]:
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
