"""``async_mode="thread"``: the native one-call step on the drafter's own thread, beside vLLM's output processing.

vLLM 0.26's synchronous engine loop, per step::

    execute_model -> sample_tokens (-> our propose) -> scheduler.update_from_output -> post_step (take drafts)

Drafting is needed only at ``take_draft_token_ids``. ``ThreadedProposerCore.submit`` (called from ``propose``) takes
the step's decisions in Python as ``ProposerCore.step`` does, hands the rows to the native suffix engine
(``SuffixDrafter.lane_submit``: a copy of the rows, no trie work) and returns; the engine's lane thread then runs the
whole step (stops, extends, restarts, drafting, cut, padding) with the GIL released while vLLM's scheduler runs
``update_from_output`` in Python. ``collect`` (from the plugin's ``take_draft_token_ids`` hook) waits for it, at
most ``draft_timeout_ms``: a later step gets no drafts (counted as a timeout, logged once) and its drafts are
dropped. Same drafts as the synchronous path step for step (``tests/test_vllm_thread.py``).

``ThreadDrafting`` is the mode's face to the proposer (``propose``, ``prepare``, ``collect``, as ``SyncDrafting`` in
``modes/sync.py``). A thread needs no copy of the drafter's state and no pickling, and the trie work never holds the
GIL.
Drafters without a native lane (``ngram``, ``model``, compositions, the Python suffix backend) draft synchronously
in ``submit``; so does every drafter after ``LANE_MAX_OVERRUNS`` late steps (``ProposerCore._leave_lane``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from specdec.vllm_plugin.core.adaptive import bucket_of
from specdec.vllm_plugin.core.batch import StepBatch
from specdec.vllm_plugin.core.engine import LANE_MAX_OVERRUNS, StepPlan
from specdec.vllm_plugin.core.gil import quick_reacquire
from specdec.vllm_plugin.core.proposer_core import ProposerCore
from specdec.vllm_plugin.logs import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)
# what lane_collect reports per step (us): submit -> the job starts on the drafter's thread, the job itself,
# submit -> collect is called (the window vLLM's own work gives the job), collect's wait
TIMING_KEYS = ("wake_us", "run_us", "window_us", "wait_us")


class ThreadedProposerCore(ProposerCore):
    """``ProposerCore`` whose step is split in ``submit`` (at propose) and ``collect`` (at take)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._plan: StepPlan | None = None  # a submitted lane step
        self._ready: list[list[int]] | None = None  # drafts of a step drafted synchronously in submit
        self._lane_busy = False  # a lane job (prepare or step) may still run on the drafter's thread
        self.stats_collect_seconds = 0.0  # engine-thread time spent waiting in collect
        self.timing: dict[int, list[float]] = {}  # bucket -> [steps, wake, run, window, wait] (us sums)
        if self.lane is not None:
            self.lane.lane_spin(self.internal.thread_spin_us)
        else:
            logger.info(
                "specdec: async_mode='thread' needs the suffix drafter's native step; drafting "
                "synchronously (drafter %r)",
                self.options.drafter,
            )

    def prepare(self, finished: Iterable[str], new: Iterable[tuple[str, Sequence[int] | None]]) -> None:
        """When vLLM starts executing a step (its scheduler output known, no tokens sampled yet): stop the
        requests that finished and start the new ones from their prompts, on the drafter's thread while the GPU
        runs. Optional (``submit`` stops and starts whatever this missed); the drafts are the same either way up
        to the order in which responses reach the global trie."""
        if self.lane is None:
            return
        self._drop_uncollected()
        known = self.lane.request_ids
        stops = [r for r in finished if r in known]
        starts = [(r, p) for r, p in new if p]  # prompt_token_ids is None for prompt embeddings: restart later
        if not stops and not starts:
            return
        self.stats.stopped += len(stops)
        self.note_started_early([r for r, _ in starts])
        self._lane_busy = True
        self.lane.lane_prepare(stops, starts)

    def submit(self, batch: StepBatch) -> None:
        """Start a step (as ``ProposerCore.step`` takes it); its drafts come from ``collect``."""
        self._drop_uncollected()
        if self.lane is None:
            self._ready = self.step(batch)
            return
        sampled = batch.sampled
        plan = self._begin(batch.req_ids, list(map(len, sampled)), batch.k, tokens=sampled.__getitem__)
        stops = self._absent(plan.present)
        self.stats.stopped += len(stops)
        self.lane.lane_submit(
            list(batch.req_ids[: plan.rows]),
            sampled,
            batch.num_tokens,
            batch.token_ids,
            batch.num_prompt_tokens,
            decisions=self.lane_decisions(plan),
            stops=stops,
        )
        self._plan, self._lane_busy = plan, True
        self.stats.propose_seconds += self.clock() - plan.t0

    def _drop_uncollected(self) -> None:
        """A step submitted but never collected: vLLM went on without its drafts (the engine clears them from the
        request books before its next call)."""
        if self._plan is not None:
            plan, self._plan = self._plan, None
            self._end(plan, [[] for _ in range(plan.rows)])

    def collect(self) -> list[list[int]] | None:
        """Drafts of the submitted step (None if none was submitted), waiting at most ``draft_timeout_ms`` (0: no
        deadline). A step still running then gets no drafts: counted, and after LANE_MAX_OVERRUNS of them drafting
        goes synchronous (the Python path) for good."""
        if self._ready is not None:
            drafts, self._ready = self._ready, None
            return drafts
        plan, self._plan = self._plan, None
        if plan is None:
            return None
        assert self.lane is not None  # a plan is only submitted to the lane, and only collect leaves it
        t0 = self.clock()
        with quick_reacquire():  # vLLM's engine thread must not wait a switch interval for the GIL after it
            result = self.lane.lane_collect(self.timeout_s if self.timeout_s > 0 else None)
        spent = self.clock() - t0
        self.stats.propose_seconds += spent
        self.stats_collect_seconds += spent
        if result is None:
            self._lane_overruns += 1
            if self._lane_overruns >= LANE_MAX_OVERRUNS:
                self._leave_lane()
                self._lane_busy = False  # the Python path's drafter calls wait for the lane job as any call does
            self.on_timeout(plan.running)
            return self._end(plan, [[] for _ in range(plan.rows)])
        drafts, accepted, drafted, started, resyncs, timing = result
        self._lane_busy = False
        sums = self.timing.setdefault(bucket_of(plan.running), [0.0] * (1 + len(TIMING_KEYS)))
        sums[0] += 1
        for i, us in enumerate(timing, 1):
            sums[i] += us
        self.stats.accepted_tokens += accepted
        self.stats.started += started
        self.stats.resyncs += resyncs
        return self._end(plan, drafts, drafted)

    def _drafter_idle(self) -> bool:
        """Not while a lane job may run (between submit or prepare and a collect that got its drafts): any call
        on the drafter would wait for it and drop its drafts."""
        return not self._lane_busy and super()._drafter_idle()

    def stats_dict(self) -> dict[str, Any]:
        d = super().stats_dict()
        d["async_mode"] = "thread"
        d["collect_wait_ms_per_step"] = 1e3 * self.stats_collect_seconds / max(self.stats.steps, 1)
        d["thread_spin_us"] = self.internal.thread_spin_us
        d["lane_threads"] = max(1, self.options.lane_threads)
        d["thread_timing_us"] = {  # per batch-size bucket, means per collected step
            str(b): {"steps": int(v[0]), **{k: v[i] / v[0] for i, k in enumerate(TIMING_KEYS, 1)}}
            for b, v in sorted(self.timing.items())
            if v[0]
        }
        return d


class ThreadDrafting:
    """Thread mode's calls from the proposer: ``propose`` submits the step, ``collect`` (the take hook) returns its
    drafts, ``prepare`` (the execute hook) stops and starts requests early. ``hand_off``: the take hook is applied,
    so ``propose`` returns placeholders and the drafts come from ``collect``; without it ``propose`` collects at
    once."""

    def __init__(self, core: ThreadedProposerCore, *, hand_off: bool) -> None:
        self.core = core
        self.hand_off = hand_off

    def propose(self, batch: StepBatch) -> list[list[int]]:
        """Submit the step; its drafts, or placeholders under the hand-off."""
        n = batch.rows
        self.core.submit(batch)
        if self.hand_off:
            return [[] for _ in range(n)]  # replaced in take_draft_token_ids
        return self.core.collect() or [[] for _ in range(n)]

    def prepare(self, scheduler_output: Any) -> None:
        """As vLLM starts executing a step: its finished requests stop and its new ones start on the drafter's
        thread while the GPU runs."""
        new = [(r.req_id, r.prompt_token_ids) for r in getattr(scheduler_output, "scheduled_new_reqs", ())]
        self.core.prepare(getattr(scheduler_output, "finished_req_ids", ()) or (), new)

    def collect(self) -> list[list[int]] | None:
        """The submitted step's drafts (None if none is pending)."""
        return self.core.collect()
