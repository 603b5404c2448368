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

import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from specdec.drafters.base import Drafter, DraftGuard, DraftRequest
from specdec.tree import ROOT, TokenTree
from specdec.vllm_plugin.adaptive import AdaptiveController, update_acceptance
from specdec.vllm_plugin.options import SpecdecOptions

logger = logging.getLogger("specdec.vllm")

Op = tuple  # ("start", rid, prompt) | ("extend", rid, tokens) | ("stop", rid)


@dataclass
class RequestState:
    n_known: int  # context length the drafter has seen
    last_draft: int = 0  # tokens drafted for it at the previous step
    acceptance_ema: float | None = None


@dataclass
class ProposerStats:
    steps: int = 0
    rows: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # of our drafts, as seen from the next step's sampled lengths
    emitted_tokens: int = 0
    propose_seconds: float = 0.0  # wall time inside propose (critical path: GPU idle meanwhile)
    timeouts: int = 0
    busy_skips: int = 0  # steps skipped because a timed-out draft was still running
    resyncs: int = 0
    started: int = 0
    stopped: int = 0
    plain_steps: int = 0

    def as_dict(self) -> dict[str, float]:
        d = dict(self.__dict__)
        d["propose_ms_per_step"] = 1e3 * self.propose_seconds / max(self.steps, 1)
        d["acceptance_rate"] = self.accepted_tokens / max(self.drafted_tokens, 1)
        return d


def best_chain(tree: TokenTree) -> tuple[np.ndarray, np.ndarray | None]:
    """The chain to submit: the tree itself if it is one, else the greedy-by-probability root path.

    Returns (tokens [m], path probabilities [m] or None when the drafter gave no probabilities).
    """
    if len(tree) == 0:
        return tree.tokens, None
    if tree.is_chain():
        return tree.tokens, (tree.path_probs() if tree.probs is not None else None)
    path, node = [], ROOT
    while True:
        kids = tree.children(node)
        if not kids:
            break
        node = max(kids, key=lambda c: float(tree.probs[c])) if tree.probs is not None else kids[0]
        path.append(node)
    probs = tree.path_probs()[path] if tree.probs is not None else None
    return tree.tokens[path], probs


class DraftWorker:
    """Runs drafter work on one background thread so a step can give up waiting at a deadline.

    All drafter calls (lifecycle ops and drafting) run on that one thread, in submission order, so the drafter
    needs no locking. While a timed-out job still runs, later steps queue their ops and get no drafts.
    """

    def __init__(self) -> None:
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-draft")
        self._last: cf.Future | None = None

    @property
    def busy(self) -> bool:
        return self._last is not None and not self._last.done()

    def run(self, fn: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
        """(finished, result) of ``fn`` run on the worker, waiting at most ``timeout_s``."""
        self._last = self._pool.submit(fn)
        try:
            return True, self._last.result(timeout=timeout_s)
        except cf.TimeoutError:
            return False, None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class ProposerCore:
    """Turns vLLM's per-step rows into drafter calls and chain drafts (see the module docstring)."""

    def __init__(self, drafter: Drafter, options: SpecdecOptions, *, max_model_len: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.options = options
        self.k = options.num_speculative_tokens
        self.max_model_len = max_model_len
        self.guard = DraftGuard(drafter, strict=options.strict)
        self.requests: dict[str, RequestState] = {}
        self.stats = ProposerStats()
        self.clock = clock
        self.adaptive = AdaptiveController(
            enabled=options.adaptive, min_path_prob=options.min_path_prob,
            min_path_prob_per_seq=options.min_path_prob_per_seq, min_acceptance=options.min_acceptance,
            window_steps=options.probe_window_steps, probe_every=options.probe_every,
            min_speedup=options.min_speedup)
        self.timeout_s = options.draft_timeout_ms / 1e3
        self.worker = DraftWorker() if self.timeout_s > 0 else None
        self._pending: list[Op] = []
        self._timeout_logged = False
        self._last_log = clock()

    # ----------------------------------------------------------------- the step
    def step(self, req_ids: Sequence[str], sampled_token_ids: Sequence[Sequence[int]],
             num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray, *,
             num_prompt_tokens: np.ndarray | None = None, k: int | None = None) -> list[list[int]]:
        """One proposer call. Arrays are vLLM's: ``num_tokens_no_spec`` [max_num_reqs] int32,
        ``token_ids_cpu`` [max_num_reqs, max_model_len] int32, ``num_prompt_tokens`` [max_num_reqs]."""
        t0 = self.clock()
        n_rows = len(sampled_token_ids)
        if len(req_ids) < n_rows:
            raise ValueError(f"{len(req_ids)} request ids for {n_rows} rows of sampled tokens")
        k = self.k if k is None else max(0, min(int(k), self.k))
        self.stats.steps += 1
        self.stats.rows += n_rows
        emitted = sum(len(s) for s in sampled_token_ids)
        self.stats.emitted_tokens += emitted
        self.adaptive.observe(emitted)
        self._stop_absent(set(req_ids[:n_rows]))
        running = sum(1 for s in sampled_token_ids if s)
        mode = self.adaptive.mode(running, t0) if running else "plain"
        orders: list[DraftRequest | None] = [None] * n_rows
        for i in range(n_rows):
            orders[i] = self._row(i, req_ids[i], sampled_token_ids[i], int(num_tokens_no_spec[i]),
                                  token_ids_cpu, num_prompt_tokens, k, mode)
        drafts = self._draft(orders, running)
        for i, d in enumerate(drafts):
            st = self.requests.get(req_ids[i])
            if st is not None:
                st.last_draft = len(d)
        self.stats.drafted_tokens += sum(len(d) for d in drafts)
        self.stats.plain_steps += mode == "plain"
        self.stats.propose_seconds += self.clock() - t0
        self._maybe_log()
        return drafts

    def _row(self, i: int, rid: str, sampled: Sequence[int], n: int, token_ids_cpu: np.ndarray,
             num_prompt_tokens: np.ndarray | None, k: int, mode: str) -> DraftRequest | None:
        if not sampled:  # partial prefill or a discarded row: no new tokens, no draft
            return None
        st = self.requests.get(rid)
        if st is not None and st.n_known + len(sampled) == n:
            self._pending.append(("extend", rid, list(sampled)))
            accepted = min(len(sampled) - 1, st.last_draft)
            self.stats.accepted_tokens += accepted
            st.acceptance_ema = update_acceptance(st.acceptance_ema, st.last_draft, accepted)
            st.n_known = n
        else:
            if st is not None:
                self.stats.resyncs += 1
                self._pending.append(("stop", rid))
            p = n - len(sampled)
            if num_prompt_tokens is not None:
                p = max(1, min(int(num_prompt_tokens[i]), n))
            ctx = np.asarray(token_ids_cpu[i, :n]).tolist()  # copy: the row's buffer changes later
            self._pending.append(("start", rid, ctx[:p]))
            if n > p:
                self._pending.append(("extend", rid, ctx[p:]))
            st = self.requests[rid] = RequestState(n_known=n)
            self.stats.started += 1
        budget = min(k, self.max_model_len - n - 1)
        budget = self.adaptive.request_budget(budget, st.acceptance_ema)
        if mode == "plain" or budget <= 0:
            return None
        return DraftRequest(rid, budget, tree=False)

    def _stop_absent(self, present: set[str]) -> None:
        for rid in [r for r in self.requests if r not in present]:
            del self.requests[rid]
            self._pending.append(("stop", rid))
            self.stats.stopped += 1

    # ----------------------------------------------------------------- drafting
    def _draft(self, orders: list[DraftRequest | None], running: int) -> list[list[int]]:
        wanted = [o for o in orders if o is not None]
        ops, self._pending = self._pending, []
        job = lambda: self._job(ops, wanted)  # noqa: E731
        if self.worker is None:
            trees = job()
        elif self.worker.busy:
            self._pending = ops + self._pending  # applied, in order, by the next job
            self.stats.busy_skips += 1
            return [[] for _ in orders]
        elif not wanted:  # nothing to draft: the ops (fast) run inline
            trees = job()
        else:
            finished, trees = self.worker.run(job, timeout_s=self.timeout_s)
            if not finished:
                self._on_timeout(len(wanted))
                return [[] for _ in orders]
        cut = self.adaptive.cut(running)
        it = iter(trees or [])
        return [self._chain(next(it), o.budget, cut) if o is not None else [] for o in orders]

    def _job(self, ops: list[Op], wanted: list[DraftRequest]) -> list[TokenTree]:
        for op in ops:
            self.guard.call(op[0], *op[1:])
        return self.guard.draft_batch(wanted) if wanted else []

    @staticmethod
    def _chain(tree: TokenTree, budget: int, cut: float) -> list[int]:
        tokens, probs = best_chain(tree)
        m = min(len(tokens), budget)
        if probs is not None and cut > 0:
            low = np.flatnonzero(probs[:m] < cut)
            m = int(low[0]) if low.size else m
        return [int(t) for t in tokens[:m]]

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
        d["active_requests"] = len(self.requests)
        d["adaptive"] = self.adaptive.as_dict()
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
        if self.worker is not None:
            self.worker.close()
        self.guard.drafter.close()
