"""Asynchronous drafting: ``AsyncDrafter`` takes drafting off the GPU's critical path.

``AsyncDrafter(inner)`` wraps any ``Drafter`` and has the same interface. Per step the engine calls
``extend(id, emitted)`` then ``draft_batch(...)``; those drafts go to the GPU for verification. While
the GPU verifies, a background worker pre-drafts the NEXT step's draft for the most likely outcomes
of that verification ("hedges", ranked by ``specdec.hedge.rank_outcomes``), with
``inner.draft_after(id, emitted, budget)``, which changes no drafter state. When the real outcome
arrives through ``extend``, the next ``draft_batch`` is a dictionary lookup on a hit; on a miss it
waits at most ``wait_ms`` for a matching hedge in flight, then drafts synchronously (``on_miss="sync"``)
or hands out no draft for that step (``on_miss="empty"``). Updates to the inner drafter
(start/extend/stop) are queued in order and applied by the worker (or by the main thread right
before a synchronous draft), so on a hit the critical path does no drafter work at all.

Correctness: every inner call is serialized by one lock (drafters need not be thread-safe); a hedge is
drafted only while the inner state is at the epoch it was planned for; results that arrive after
their request moved on, was stopped or restarted are discarded (counted as stale). Drafts never
affect what is emitted (the verifier decides), so the pipeline is lossless by construction; the tests
check the bookkeeping with a simulated verifier. Threads, not processes: see docs/async.md. The worker threads'
half (applying updates, planning and drafting hedges) is ``specdec.pipeline_worker.HedgeWorker``.
"""
from __future__ import annotations

import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from specdec.config import ConfigBase, rng
from specdec.drafters.base import DraftGuard, Drafter, DraftRequest
from specdec.pipeline_state import AsyncStats, Job, ReqState
from specdec.pipeline_worker import HedgeWorker
from specdec.tree import TokenTree

MISS_CHUNK = 4  # misses drafted per inner call under on_miss="budget"
CYCLE_EMA_ALPHA = 0.2  # weight of the latest step in the step-time average


@dataclass(frozen=True)
class AsyncConfig(ConfigBase):
    hedge_width: int = rng(4, lo=0, hi=64, doc="outcomes pre-drafted per request per step (0: no hedging)")
    bonus_per_path: int = rng(2, lo=1, hi=16, doc="bonus-token candidates considered per accepted path")
    probe_budget: int = rng(48, lo=1, hi=512, doc="nodes of the drafter's tree used to rank outcomes")
    wait_ms: float = rng(1.0, lo=0.0, hi=1000.0, doc="max wait (per step) for an in-flight matching hedge")
    on_miss: str = rng("sync", choices=("sync", "empty", "budget"),
                       doc="after a miss: draft synchronously, no draft, or synchronously within miss_budget_us")
    miss_budget_us: float = rng(200.0, lo=0.0, hi=1e7,
                                doc="on_miss='budget': engine-thread time per draft_batch for drafting misses")
    max_jobs: int = rng(2, lo=1, hi=1024, doc="bounded hedge-job queue; the oldest job is dropped when full")
    num_workers: int = rng(1, lo=1, hi=8, doc="background threads (inner calls stay serialized)")
    defer_updates: bool = rng(True, doc="apply start/extend/stop to the inner drafter in the background")
    job_switch_interval_us: int = rng(200, lo=0, hi=100_000,
                                      doc="sys.setswitchinterval while a hedge job runs (restored after), so "
                                          "the engine thread regains the GIL quickly when the GPU step ends; 0: leave")
    gate_ms: float = rng(0.0, lo=0.0, hi=1000.0,
                         doc="if > 0, a hedge job waits for open_gate() (the engine launched the GPU step) "
                             "or at most this long, so hedging does not compete for the GIL with the engine")
    window_frac: float = rng(0.8, lo=0.0, hi=100.0,
                             doc="a hedge job stops after this fraction of the usual time between two "
                                 "draft_batch calls (the GPU step), so it never competes with the next step; 0: never")
    min_hit_rate: float = rng(0.1, lo=0.0, hi=1.0,
                              doc="pause hedging a request whose recent planned hit rate falls below this")
    pause_steps: int = rng(16, lo=0, hi=100_000, doc="steps a request goes without hedging after that")
    strict: bool = rng(False, doc="re-raise drafter errors (debugging)")


class AsyncDrafter(HedgeWorker, Drafter):
    """Wraps ``inner`` and pre-drafts hedged next-step drafts in background threads."""

    def __init__(self, inner: Drafter, config: AsyncConfig | None = None, **overrides: Any) -> None:
        base = config or AsyncConfig()
        self.config = base.replace(**overrides) if overrides else base
        self.inner = inner
        self.name = f"async({inner.name})"
        self.guard = DraftGuard(inner, strict=self.config.strict)
        self.stats = AsyncStats()
        self._reqs: dict[str, ReqState] = {}
        self._ops: deque[tuple[str, str, tuple, ReqState | None]] = deque()  # (kind, id, args, state), in order
        self._jobs: deque[Job] = deque()
        self._state = threading.Lock()  # guards _reqs, _ops, _jobs, stats
        self._cond = threading.Condition(self._state)  # job queued / hedge resolved
        self._inner_lock = threading.Lock()  # serializes every call into the inner drafter
        self._main_wants = 0  # >0 while the main thread waits for _inner_lock (workers back off)
        self._closed = False
        self._fast_jobs = 0  # jobs running with the short switch interval
        self._saved_interval = sys.getswitchinterval()
        self._rotate = 0  # start offset of the misses drafted under on_miss="budget"
        self._last_submit: float | None = None
        self._cycle_s: float | None = None  # EMA of the time from handing drafts out to the next draft_batch
        self._gate = threading.Event()  # set by open_gate(): the engine is now blocked on the GPU
        self._gate.set()
        self._logged: set[str] = set()
        # Consumers that shorten drafts after draft_batch (e.g. a probability cut) set this instead, so that
        # hedges are planned for the draft really verified: (tree, request) -> the tree handed out.
        self.postprocess: Callable[[TokenTree, DraftRequest], TokenTree] | None = None
        self._workers = [threading.Thread(target=self._worker_loop, name=f"specdec-async-{i}", daemon=True)
                         for i in range(self.config.num_workers if self.config.hedge_width else 0)]
        for w in self._workers:
            w.start()

    # ------------------------------------------------------------------ lifecycle (main thread)
    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        t0 = time.perf_counter()
        with self._state:
            old = self._reqs.get(request_id)
            if old is not None:
                old.cancelled = True
            req = self._reqs[request_id] = ReqState()
            self._ops.append(("start", request_id, (list(prompt_ids),), req))
        # Applied now, not deferred: the request's first draft (always a miss) needs it at once anyway.
        self._sync_inner(lambda: None, frozenset((request_id,)) if self._workers else None)
        self.stats.critical_seconds += time.perf_counter() - t0

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        t0 = time.perf_counter()
        key = tuple(map(int, token_ids))
        with self._state:
            req = self._reqs.get(request_id)
            if req is not None:
                self.stats.stale += req.on_extend(key)
            self._ops.append(("extend", request_id, (list(key),), req))
        self._after_update(t0)

    def stop(self, request_id: str) -> None:
        t0 = time.perf_counter()
        with self._state:
            req = self._reqs.pop(request_id, None)
            if req is not None:
                self.stats.stale += len(req.hedges)
                req.cancelled = True
            self._ops.append(("stop", request_id, (), None))
            self._cond.notify_all()
        self._after_update(t0)

    def _after_update(self, t0: float) -> None:
        if not self.config.defer_updates:
            self._sync_inner(lambda: None)
        self.stats.critical_seconds += time.perf_counter() - t0

    def active_requests(self) -> list[str]:
        with self._state:
            return list(self._reqs)

    def memory_bytes(self) -> int:
        return self.inner.memory_bytes()

    def close(self) -> None:
        with self._state:
            self._closed = True
            self._cond.notify_all()
        for w in self._workers:
            w.join(timeout=5.0)
        self.flush()
        self.inner.close()

    def open_gate(self) -> None:
        """The engine launched the step being verified (its thread now waits on the GPU and frees the GIL):
        hedging may start. Only needed with ``gate_ms > 0``; cheap, callable from any thread."""
        self._gate.set()

    def hedge_snapshot(self, request_ids: Sequence[str]) -> list[dict[tuple[int, ...], list[int]]]:
        """The ready hedges per request, ``{emitted tokens: next draft (best chain)}``, for a device-side
        lookup (``specdec.transfer.pack_hedges`` / ``select_drafts``) when the outcome is not on the host yet."""
        with self._state:
            out = []
            for rid in request_ids:
                req = self._reqs.get(rid)
                hedges = dict(req.hedges) if req is not None else {}
                out.append({k: t.to_chain().tokens.tolist() for k, t in hedges.items()})
            return out

    def flush(self) -> None:
        """Apply every queued update to the inner drafter now (e.g. before reading its state)."""
        self._sync_inner(lambda: None)

    # ------------------------------------------------------------------ drafting (main thread)
    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        t0 = time.perf_counter()
        out: list[TokenTree | None] = [None] * len(requests)
        if self._last_submit is not None:
            gap = t0 - self._last_submit
            self._cycle_s = gap if self._cycle_s is None else self._cycle_s + CYCLE_EMA_ALPHA * (gap - self._cycle_s)
        with self._state:
            self.stats.lookups += len(requests)
            waiting = self._lookup(requests, out)
            if waiting:
                self._wait_for(requests, out, waiting, t0)
        misses = [i for i, t in enumerate(out) if t is None]
        no_draft: list[int] = []
        if misses:
            no_draft = self._draft_misses(requests, misses, out, t0)
        trees = [t if t is not None else TokenTree.empty() for t in out]
        if self.postprocess is not None:
            trees = [self.postprocess(t, r) for t, r in zip(trees, requests)]
        self._submit(requests, trees, frozenset(no_draft))
        self._last_submit = t1 = time.perf_counter()
        self.stats.critical_seconds += t1 - t0
        return trees

    def _lookup(self, requests: Sequence[DraftRequest], out: list[TokenTree | None]) -> list[int]:
        """Fill hits into ``out``; return the indices whose hedge is still in flight (under _state)."""
        waiting = []
        for i, r in enumerate(requests):
            req = self._reqs.get(r.request_id)
            if req is None or req.resolved is None and not req.outcome_in_flight():
                self._count_miss(req)
                continue
            if req.resolved is not None:
                out[i] = _fit(req.take_resolved(), r, drafted_as_tree=req.tree)
                self.stats.hits += 1
                self._observe(req, True)
            elif self.config.wait_ms > 0:
                waiting.append(i)
            else:
                self.stats.miss_late += 1
        return waiting

    def _count_miss(self, req: ReqState | None) -> None:
        if req is not None and req.outcome_planned and not req.outcome_late():
            self._observe(req, False)  # a wrong guess (late hedges do not count against the request)
        elif req is not None:
            self.stats.count_outcome(req, False)
        self.stats.count_miss(req)

    def _observe(self, req: ReqState, hit: bool) -> None:
        self.stats.count_outcome(req, hit)
        if self.config.min_hit_rate > 0:
            req.observe(hit, min_hit_rate=self.config.min_hit_rate, pause_steps=self.config.pause_steps)

    def _wait_for(self, requests: Sequence[DraftRequest], out: list[TokenTree | None], waiting: list[int],
                  t0: float) -> None:
        """Wait (holding _cond) until the in-flight hedges resolve or the step's deadline passes."""
        deadline = t0 + self.config.wait_ms * 1e-3
        pending = list(waiting)
        while pending:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            self._cond.wait(left)
            still = []
            for i in pending:
                req = self._reqs.get(requests[i].request_id)
                if req is not None and req.resolved is not None:
                    out[i] = _fit(req.take_resolved(), requests[i], drafted_as_tree=req.tree)
                    self.stats.late_hits += 1
                    self._observe(req, True)
                elif req is not None and req.outcome_in_flight():
                    still.append(i)
                else:
                    self._count_miss(req)
            pending = still
        self.stats.miss_late += len(pending)
        self.stats.wait_seconds += max(0.0, time.perf_counter() - t0)

    def _draft_misses(self, requests: Sequence[DraftRequest], misses: list[int], out: list[TokenTree | None],
                      t_call: float) -> list[int]:
        """Draft the misses: all synchronously ("sync"), none ("empty"), or as many as fit the step's
        ``miss_budget_us`` ("budget", in chunks, starting at a rotating offset so none starves)."""
        if self.config.on_miss == "sync":
            self._draft_now(requests, misses, out)
            return []
        todo = list(misses)
        if self.config.on_miss == "budget" and todo:
            deadline = t_call + self.config.miss_budget_us * 1e-6
            k = self._rotate % len(todo)
            self._rotate += 1
            todo = todo[k:] + todo[:k]
            while todo and time.perf_counter() < deadline:
                chunk, todo = todo[:MISS_CHUNK], todo[MISS_CHUNK:]
                self._draft_now(requests, chunk, out)
        for i in todo:
            out[i] = TokenTree.empty()
        self.stats.miss_no_draft += len(todo)
        if not self._workers and self._ops:  # nobody else applies queued updates
            self._sync_inner(lambda: None)
        return todo

    def _draft_now(self, requests: Sequence[DraftRequest], idx: list[int], out: list[TokenTree | None]) -> None:
        t0 = time.perf_counter()
        sub = [requests[i] for i in idx]
        # Without workers nobody else applies queued updates: apply all of them (stops included) now.
        only = frozenset(r.request_id for r in sub) if self._workers else None
        trees = self._sync_inner(lambda: self.guard.draft_batch(sub), only)
        for i, t in zip(idx, trees):
            out[i] = _fit(t, requests[i], drafted_as_tree=requests[i].tree)
        self.stats.sync_draft_seconds += time.perf_counter() - t0
        self.stats.sync_drafts += len(idx)

    def _submit(self, requests: Sequence[DraftRequest], trees: list[TokenTree], no_draft: frozenset[int]) -> None:
        """Record the drafts handed out and queue the hedge job for their verification's outcomes."""
        if not self._workers:
            return
        with self._state:
            entries = []
            for i, (r, t) in enumerate(zip(requests, trees)):
                req = self._reqs.get(r.request_id)
                if req is None:
                    continue
                req.on_draft(t, r.budget, r.tree)
                if not len(t) and i not in no_draft:  # the drafter itself had nothing: nothing to plan on
                    self.stats.skipped_empty += 1
                elif req.pause > 0:
                    req.pause -= 1
                    self.stats.skipped_paused += 1
                else:
                    entries.append((r.request_id, req, req.epoch))
            if not entries:
                return
            if len(self._jobs) >= self.config.max_jobs:
                self._jobs.popleft()
                self.stats.jobs_dropped += 1
            window = self.config.window_frac * self._cycle_s if self._cycle_s and self.config.window_frac else None
            self._jobs.append(Job(entries, deadline=time.perf_counter() + window if window else float("inf")))
            self.stats.jobs += 1
            if self.config.gate_ms > 0:
                self._gate.clear()
            self._cond.notify_all()

    # ------------------------------------------------------------------ inner access
    def _sync_inner(self, fn, only: frozenset[str] | None = None):  # type: ignore[no-untyped-def]
        """Run ``fn`` on the main thread with the inner drafter, after applying the queued updates (of the
        requests in ``only``, or all): a miss does not pay for the other requests' deferred updates."""
        t0 = time.perf_counter()
        with self._state:
            self._main_wants += 1
        try:
            with self._inner_lock:
                self._apply_ops(only)
                return fn()
        finally:
            with self._state:
                self._main_wants -= 1
            self.stats.main_inner_seconds += time.perf_counter() - t0

    def _apply_ops(self, only: frozenset[str] | None = None) -> None:
        """Apply queued start/extend/stop calls in order (caller holds _inner_lock).

        With ``only``, just those requests' calls (each request's calls stay in order; calls of different
        requests commute for correctness -- a global cache may learn them in a different order).
        """
        with self._state:
            if only is None:
                ops, self._ops = list(self._ops), deque()
            else:
                ops = [op for op in self._ops if op[1] in only]
                if ops:
                    self._ops = deque(op for op in self._ops if op[1] not in only)
        if not ops:
            return
        for kind, rid, args, _ in ops:
            self.guard.call(kind, rid, *args)
        with self._state:  # (workers check these only while holding _inner_lock, as the caller does)
            for kind, _, _, req in ops:
                if req is not None:
                    if kind == "start":
                        req.started = True
                    else:
                        req.applied_extends += 1


def _fit(tree: TokenTree, request: DraftRequest, *, drafted_as_tree: bool) -> TokenTree:
    """Shape a (possibly pre-drafted) tree for ``request``: at most its budget, a chain unless tree=True."""
    if drafted_as_tree and not request.tree and len(tree) > 1:
        return tree.to_chain(request.budget)
    return tree.truncate(request.budget)


__all__ = ["AsyncConfig", "AsyncDrafter", "AsyncStats"]
