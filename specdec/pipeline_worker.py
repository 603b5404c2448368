"""The background half of ``specdec.pipeline.AsyncDrafter``: the worker threads that apply queued drafter updates
and pre-draft hedges (probe the drafter, rank the likely outcomes of the step being verified, draft ahead for
each), all under the drafter lock and stopping as soon as the engine thread wants the drafter.

``HedgeWorker`` is a mixin: ``AsyncDrafter`` provides the state it works on (``config``, ``inner``, ``stats``,
the ``_state`` lock and its ``_cond`` condition, ``_inner_lock``, ``_jobs``, ``_ops``, ``_closed``,
``_main_wants``, ``_gate``, ``_fast_jobs``, ``_saved_interval``, ``_logged``) and ``_apply_ops``.
"""
from __future__ import annotations

import logging
import sys
import time

from specdec.hedge import Probe, best_path_tokens, hedge_from_probe, rank_outcomes
from specdec.pipeline_state import Job, ReqState
from specdec.tree import TokenTree

logger = logging.getLogger("specdec.pipeline")

_IDLE_POLL_S = 0.05  # worker wake-up period when idle (also bounds close() latency)
_YIELD_POLL_S = 0.0005  # worker back-off while the main thread wants the drafter


class HedgeWorker:
    """Worker-thread methods of ``AsyncDrafter`` (see the module docstring)."""

    def _worker_loop(self) -> None:
        while True:
            with self._state:
                while not self._jobs and not self._closed:
                    self._cond.wait(_IDLE_POLL_S)
                    if self._ops and not self._jobs and not self._main_wants:
                        break
                if self._closed:
                    return
                job = self._jobs.popleft() if self._jobs else None
            if job is not None and self.config.gate_ms > 0:
                self._gate.wait(self.config.gate_ms * 1e-3)
            t0 = time.perf_counter()
            fast = job is not None and self.config.job_switch_interval_us > 0
            if fast:
                self._fast_switch(+1)
            try:
                self._run_job(job)
            except Exception as exc:  # noqa: BLE001 - the worker must survive anything
                self._log_once("worker", exc)
                if self.config.strict:
                    raise
            finally:
                if fast:
                    self._fast_switch(-1)
                with self._state:
                    self.stats.background_seconds += time.perf_counter() - t0

    def _fast_switch(self, delta: int) -> None:
        """Shorten the GIL switch interval while any worker runs a job; restore it after the last one."""
        with self._state:
            self._fast_jobs += delta
            if delta > 0 and self._fast_jobs == 1:
                self._saved_interval = sys.getswitchinterval()
                sys.setswitchinterval(self.config.job_switch_interval_us * 1e-6)
            elif delta < 0 and self._fast_jobs == 0:
                sys.setswitchinterval(self._saved_interval)

    def _run_job(self, job: Job | None) -> None:
        self._with_inner(self._apply_ops)
        if job is None:
            return
        for rank in range(self.config.hedge_width):
            progressed = False
            for rid, req, epoch in job.entries:
                with self._state:
                    if self._closed or self._jobs_newer(job):
                        return
                    if time.perf_counter() > job.deadline:
                        self.stats.jobs_cut += 1
                        return
                    if not req.plannable(epoch, rank):
                        continue
                progressed = True
                if rank == 0:
                    self._plan(rid, req, epoch)
                self._hedge(rid, req, epoch, rank)
            if not progressed:
                return

    def _jobs_newer(self, job: Job) -> bool:
        """A newer job covers the same requests: this one is superseded (caller holds _state)."""
        return bool(self._jobs) and self._jobs[-1].ids >= job.ids

    def _with_inner(self, fn):  # type: ignore[no-untyped-def]
        """Run ``fn`` on a worker with the inner drafter, yielding to the main thread first."""
        time.sleep(0)  # a GIL release point between inner calls: a waking engine thread gets in at once
        while True:
            with self._state:
                wants = self._main_wants
            if not wants:
                break
            time.sleep(_YIELD_POLL_S)
        with self._inner_lock:
            return fn()

    def _plan(self, rid: str, req: ReqState, epoch: int) -> None:
        """Probe the drafter (at the draft's context and after its best path) and rank the outcomes."""
        leaf = best_path_tokens(req.draft) if req.draft is not None else ()

        def probe() -> list[Probe] | None:
            if not req.current(epoch) or req.epoch != epoch:
                return None
            self.stats.probes += 1
            probes = []
            for prefix in ((), leaf) if leaf else ((),):
                tree = self.inner.draft_after(rid, list(prefix), self.config.probe_budget, tree=True)
                if tree is not None:
                    probes.append((prefix, tree))
            return probes

        probes = self._guarded(probe)
        with self._state:
            if probes is None or req.epoch != epoch or req.cancelled:
                return
            req.probes, req.planned_epoch = probes, epoch
            req.plan = rank_outcomes(req.draft, probes, max_outcomes=self.config.hedge_width,
                                     bonus_per_path=self.config.bonus_per_path)
            req.in_flight = {o.emitted for o in req.plan}
            self.stats.planned += len(req.plan)

    def _hedge(self, rid: str, req: ReqState, epoch: int, rank: int) -> None:
        with self._state:
            if rank >= len(req.plan) or not req.wanted(epoch, req.plan[rank].emitted):
                return
            emitted, budget, tree_ok = req.plan[rank].emitted, req.budget, req.tree
            req.computing = emitted

        def draft() -> TokenTree | None:
            if not req.current(epoch):
                return None
            t = self.inner.draft_after(rid, list(emitted), budget, tree=tree_ok)
            if t is None and req.probes:  # the drafter cannot draft ahead: cut the hedge from a probe
                self.stats.hedges_from_probe += 1
                t = hedge_from_probe(req.probes, emitted, budget, tree=tree_ok)
            return t

        tree = self._guarded(draft)
        with self._state:
            req.in_flight.discard(emitted)
            req.computing = None
            if tree is None:
                self._cond.notify_all()
                return
            self.stats.hedges += 1
            self.stats.stale += req.store(epoch, emitted, tree.truncate(budget))
            self._cond.notify_all()

    def _guarded(self, fn):  # type: ignore[no-untyped-def]
        try:
            return self._with_inner(fn)
        except Exception as exc:  # noqa: BLE001 - a failed hedge is only a lost hedge
            with self._state:
                self.stats.hedge_errors += 1
            self._log_once("hedge", exc)
            if self.config.strict:
                raise
            return None

    def _log_once(self, where: str, exc: BaseException) -> None:
        key = f"{where}:{type(exc).__name__}"
        if key not in self._logged:
            self._logged.add(key)
            logger.warning("async drafting (%s) failed: %r; the step falls back to synchronous drafting "
                           "(counted; further %s errors not logged)", where, exc, key)
