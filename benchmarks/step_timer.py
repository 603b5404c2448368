"""``StepTimer``: the vLLM benchmark's timing hooks (engine in-process, V1 model runner): drafting time, GPU busy time
and idle gaps per step (CUDA events), and in schedule mode the gap's split at the device wait, feeding a
``step_trace.StepTrace`` when one is given (``bench_vllm --trace``; the columns are described in ``step_trace``).
On vLLM's Model Runner V2 (no speculation's, where vLLM picks it) the steps, trace rows and host phases only."""

from __future__ import annotations

import faulthandler
import functools
import itertools
import os
import time
from typing import Any, Protocol

from benchmarks.step_trace import StepTrace

# diagnostic: a measured step whose execute_model runs longer than this many seconds dumps every thread's Python
# stack to stderr (faulthandler), to find a stall's place
STALL_DUMP_ENV = "SPECDEC_BENCH_STALL_DUMP_S"


class CellTimer(Protocol):
    """What a benchmark cell needs of its timer: ``StepTimer`` (engine core in this process) or
    ``engine_timer.EngineTimer`` (its proxy for an engine core in a process of its own)."""

    gpu_on: bool

    def collect_gpu(self) -> None: ...

    def counts(self) -> dict[str, float]: ...

    def take_trace(self) -> dict[str, list[Any]] | None: ...


class StepTimer:
    """Wraps GPUModelRunner.execute_model / propose_draft_token_ids and the executor's take_draft_token_ids (engine
    in-process) to time drafting: the time spent in propose plus the wait for the drafts' hand-off (schedule mode:
    its capture, fill and finish phases instead of propose, told through the plugin's timing hook,
    ``drafting_phase``).

    GPU idle gaps (V1 model runner): a CUDA event is recorded on the runner's stream when a forward pass is
    enqueued (``_model_forward``) and one after the step's sampling work (``_bookkeeping_sync`` entry). The GPU
    reaches the second when that step's work is done and the first of the next step when the next forward's work
    begins, so ``gap`` = elapsed(end of step N, start of step N+1) is the GPU's idle time between forward passes
    (whatever the CPU does meanwhile: vLLM's bookkeeping and scheduling, drafting), ``busy`` = elapsed(start,
    end) of a step. "GPU waiting for drafts" = a method's gap minus no-spec's (``nospec-v1``: same runner)."""

    def __init__(self, trace: StepTrace | None = None) -> None:
        self.trace = trace  # per-step records (--trace)
        self.steps = 0
        self.draft_s = 0.0
        self._gpu_on = False  # record events (only inside measured generate calls; never during graph capture)
        self.events: list[tuple[Any, Any, int]] = []  # (forward start, sampling end, trace row) per step of a call
        self._start: Any = None
        # schedule mode, device wait: the event behind each step's wait for drafts, and the host's drafting times
        self._held: Any = None  # recorded at the wait's enqueue (this step's, before its forward starts)
        self.held_events: dict[int, Any] = {}  # trace row -> its wait event
        self.host_split: dict[int, dict[str, float]] = {}  # trace row -> {"sync_ms", "finish_ms"}
        self.host_phase: dict[int, dict[str, float]] = {}  # trace row -> host time of vLLM's phases in its period
        self._sync_s = 0.0
        self.gap_ms = self.busy_ms = 0.0
        self.gap_n = 0

    def install(self) -> None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        runners = [GPUModelRunner, *([v2] if (v2 := v2_runner()) is not None else [])]
        for runner in runners:  # an engine runs on one of them: its steps are counted and traced either way
            runner.execute_model = self._stepped(runner.execute_model)
        if self.trace is not None:
            self.trace.install()
            from vllm.v1.core.sched.scheduler import Scheduler

            self._install_phases(runners, Scheduler)
        GPUModelRunner.propose_draft_token_ids = self._timed(GPUModelRunner.propose_draft_token_ids)
        for name, hook in (("_model_forward", self._forward_started), ("_bookkeeping_sync", self._sampling_done)):
            if hasattr(GPUModelRunner, name):
                setattr(GPUModelRunner, name, self._marked(getattr(GPUModelRunner, name), hook))
        # schedule mode's drafting phases: the plugin's timing hook (drafting_phase), given to its proposers when a
        # measured call starts (gpu_on), once the engine exists
        try:  # the hand-off of drafts to the scheduler: where overlapped drafting ("async") waits for its helper
            from vllm.v1.executor.uniproc_executor import UniProcExecutor

            UniProcExecutor.take_draft_token_ids = self._timed(UniProcExecutor.take_draft_token_ids)
        except (ImportError, AttributeError):
            pass

    @property
    def gpu_on(self) -> bool:
        return self._gpu_on

    @gpu_on.setter
    def gpu_on(self, on: bool) -> None:
        """Inside measured calls: record events, and time schedule mode's drafting through the plugin's hook
        (``specdec.vllm_plugin.observe``: every proposer of this process, the engine's included)."""
        if on:
            from specdec.vllm_plugin.observe import observe

            observe(self)
        self._gpu_on = on

    def drafting_phase(self, phase: str, seconds: float) -> None:
        """The plugin's timing hook (``observe.DraftingObserver``): the capture, the fill and a deferred fill's
        drafting count as drafting time; the drafting (``finish_ms``) and its reading of a step's tokens
        (``sync_ms``, mostly waiting for the GPU) go to the trace row's split too; after the device wait's enqueue,
        an event the GPU reaches once the wait is released."""
        from specdec.vllm_plugin.observe import OUTER_PHASES, PHASE_FINISH, PHASE_TOKENS, PHASE_WAIT

        if phase == PHASE_WAIT:  # the wait for drafts is enqueued: the GPU reaches this event once it is released
            if self.trace is not None:
                self._held = self._event()
            return
        if phase in OUTER_PHASES:
            self.draft_s += seconds
        if phase in (PHASE_FINISH, PHASE_TOKENS):
            self._add_to_row("host_split", "finish_ms" if phase == PHASE_FINISH else "sync_ms", seconds)

    def _stepped(self, run: Any) -> Any:
        """A runner's ``execute_model`` counting its steps and opening a trace row per measured step (and, with
        ``STALL_DUMP_ENV``, dumping every thread's stack when one runs too long)."""
        timer = self
        dump_s = float(os.environ.get(STALL_DUMP_ENV) or 0.0)

        @functools.wraps(run)  # keeps the signature visible (the plugin's runner patch checks it)
        def execute_model(self: Any, *a: Any, **kw: Any) -> Any:
            timer.steps += 1
            if timer.trace is not None and timer.gpu_on:
                timer.trace.step(a[0] if a else kw.get("scheduler_output"), timer.draft_s)
            if not (dump_s > 0 and timer.gpu_on):
                return run(self, *a, **kw)
            faulthandler.dump_traceback_later(dump_s)
            try:
                return run(self, *a, **kw)
            finally:
                faulthandler.cancel_dump_traceback_later()

        return execute_model

    def _install_phases(self, runners: list[Any], scheduler_cls: Any) -> None:
        """Host time of the engine loop's phases per step period (``step_trace.PHASE_COLS``): what the engine
        core's thread does between two ``execute_model`` entries, wherever the GPU is meanwhile."""
        from specdec.vllm_plugin.patches import async_slots

        # the plugin's schedule wrapper (AsyncScheduler, set after this) calls vLLM's schedule and these two by name
        for owner, name, col in (
            *((r, "execute_model", "exec_ms") for r in runners),
            *((r, "sample_tokens", "sample_ms") for r in runners),
            (scheduler_cls, "schedule", "sched_ms"),
            (async_slots, "regrant_placeholders", "sched_ms"),
            (async_slots, "cap_prefill_steps", "sched_ms"),
            (scheduler_cls, "update_from_output", "update_ms"),
        ):
            fn = getattr(owner, name, None)
            if fn is not None:
                setattr(owner, name, self._phase(fn, col))

    def counts(self) -> dict[str, float]:
        """Running totals (a cell's figures are differences of two snapshots): engine steps, drafting seconds, GPU
        gap and busy ms, and the number of gaps measured."""
        return {
            "steps": self.steps,
            "draft_s": self.draft_s,
            "gap_ms": self.gap_ms,
            "busy_ms": self.busy_ms,
            "gap_n": self.gap_n,
        }

    def take_trace(self) -> dict[str, list[Any]] | None:
        """The steps recorded since the last call (``StepTrace.cell``), or None without a trace."""
        return self.trace.cell() if self.trace is not None else None

    def _event(self) -> Any:
        import torch

        if not self.gpu_on or torch.cuda.is_current_stream_capturing():
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _forward_started(self) -> None:
        self._start = self._event()
        if self._held is not None and self.trace is not None:
            self.held_events[self.trace.current] = self._held
        self._held = None

    def _phase(self, fn: Any, key: str) -> Any:
        """``fn`` with its wall time added to ``key`` (ms) of the step period it ran in, in ``host_phase``."""
        return self._row_timed(fn, key, "host_phase")

    def _row_timed(self, fn: Any, key: str, book: str) -> Any:
        """``fn`` with its wall time (ms) added to ``self.<book>[current trace row][key]`` during measured calls (the
        book is looked up per call: ``collect_gpu`` replaces it after each generate call)."""

        return _wall_timed(fn, lambda seconds: self._add_to_row(book, key, seconds))

    def _add_to_row(self, book: str, key: str, seconds: float) -> None:
        """``seconds`` (as ms) added to ``self.<book>[current trace row][key]`` during measured calls (the book is
        looked up per call: ``collect_gpu`` replaces it after each generate call)."""
        if self.trace is not None and self.gpu_on:
            row = getattr(self, book).setdefault(self.trace.current, {})
            row[key] = row.get(key, 0.0) + 1e3 * seconds

    def _sampling_done(self) -> None:
        end = self._event()
        if end is not None and self._start is not None:
            self.events.append((self._start, end, self.trace.current if self.trace is not None else -1))
        self._start = None

    @staticmethod
    def _marked(fn: Any, hook: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            hook()
            return fn(*a, **kw)

        return wrapper

    def collect_gpu(self) -> None:
        """Fold the events of the generate call that just finished (all complete) into busy/gap totals."""
        ev = self.events
        if ev:  # async scheduling: generate() can return before the GPU ran the last step's recorded work
            ev[-1][1].synchronize()
        per_step: dict[int, tuple[float, float | None]] = {}
        for (s0, e0, i0), (s1, _e1, _i1) in itertools.pairwise(ev):
            busy, gap = s0.elapsed_time(e0), e0.elapsed_time(s1)
            self.busy_ms += busy
            self.gap_ms += gap
            self.gap_n += 1
            per_step[i0] = (busy, gap)
        if ev:
            per_step.setdefault(ev[-1][2], (ev[-1][0].elapsed_time(ev[-1][1]), None))
        if self.trace is not None:
            split = self._gap_split(ev)
            for i, phases in self.host_phase.items():
                split.setdefault(i, {}).update(phases)
            self.trace.end_call(self.draft_s, per_step, split)
        self.events, self._start = [], None
        self.held_events, self.host_split, self.host_phase, self._held = {}, {}, {}, None

    def _gap_split(self, ev: list[tuple[Any, Any, int]]) -> dict[int, dict[str, float]]:
        """Per trace row: the gap after it split at the next step's wait event, and the host's drafting times
        (the drafting that ends the gap after step N runs during step N+1's ``execute_model``)."""
        out: dict[int, dict[str, float]] = {}
        for (_s0, e0, i0), (s1, _e1, i1) in itertools.pairwise(ev):
            held = self.held_events.get(i1)
            parts: dict[str, float] = dict(self.host_split.get(i1, {}))
            if held is not None:
                parts["held_ms"], parts["after_ms"] = e0.elapsed_time(held), held.elapsed_time(s1)
            if parts:
                out[i0] = parts
        return out

    def _timed(self, fn: Any) -> Any:
        """``fn`` with its wall time added to ``draft_s`` (signature kept visible for the plugin's checks)."""

        def add(seconds: float) -> None:
            self.draft_s += seconds

        return _wall_timed(fn, add)


def v2_runner() -> Any:
    """vLLM's Model Runner V2 class, which no speculation runs on where it can (steps, trace rows and host phases;
    its GPU busy and idle times are not recorded: the CUDA events mark V1's forward and sampling), or None where this
    vLLM has none or cannot import it here."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    except Exception:  # noqa: BLE001 - an older vLLM, or a V2 runner needing what this machine lacks
        return None
    return GPUModelRunner


def _wall_timed(fn: Any, add: Any) -> Any:
    """``fn`` (signature kept visible through ``functools.wraps``) calling ``add(seconds)`` with each call's wall time,
    whether it returns or raises."""

    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            add(time.perf_counter() - t0)

    return wrapper
