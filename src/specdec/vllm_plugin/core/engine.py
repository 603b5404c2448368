"""The one typed interface between ``ProposerCore`` and the engine that drafts a step's rows (``StepEngine``), and
its native implementation (``LaneEngine``: the drafter's one-call lane, ``lane.py``).

``ProposerCore`` takes every step's decisions (``StepPlan``: the draft length limit, spec or plain, padding) and
keeps the statistics; the engine holds the requests it drafts for and turns the rows into drafts. Two engines give
the same drafts and statistics (``tests/test_vllm_lane.py``): ``PythonEngine`` (``python_engine.py``: per-row
bookkeeping, a batched drafter job, maybe on the deadline thread) for any drafter, and ``LaneEngine`` for a drafter
that offers a lane (the native suffix drafter). The proposer starts on the lane where there is one and falls back
to the Python engine for good after ``LANE_MAX_OVERRUNS`` late steps.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

from specdec.drafters.suffix_lane import LaneDecisions
from specdec.vllm_plugin.core.adaptive import StepCostModel
from specdec.vllm_plugin.core.batch import StepBatch
from specdec.vllm_plugin.core.lane import Lane, LaneCounts, lane_step

LANE_MAX_OVERRUNS = 3  # native-step calls over the deadline before the proposer falls back to the Python engine


class StepPlan(NamedTuple):
    """One step's decisions, taken before drafting (``ProposerCore._begin``)."""

    t0: float  # clock at the step's start
    rows: int
    k: int  # draft length limit this step
    mode: str  # "spec" or "plain"
    running: int  # rows with new tokens
    present: set[str]  # the step's request ids (those the drafter holds beyond them are stopped)
    ids: Sequence[str] = ()  # [rows] the step's request ids by row
    pad: bool = False  # every row submits exactly its room (a uniform batch: pad_drafts)


class StepHost(Protocol):
    """What a drafting engine asks of the ``ProposerCore`` that owns it (its clock, decisions and statistics):
    the engines call nothing else of the core."""

    clock: Callable[[], float]
    timeout_s: float  # the drafting deadline (0: none)
    max_model_len: int
    stats: Any  # its ProposerStats (state.py): the engines count accepted tokens, starts, resyncs, skips
    guard: Any  # the drafter behind its error guard (the Python engine's jobs)
    internal: Any  # its InternalSettings (deadline_mode)
    adaptive: Any  # its AdaptiveController (the confidence cut)

    def lane_decisions(self, plan: StepPlan) -> LaneDecisions:
        """The step's decisions for a lane call."""
        ...

    def cost_model(self, running: int) -> StepCostModel:
        """The step-cost fit of batches of ``running`` requests."""
        ...

    def count_lane(self, counts: LaneCounts) -> None:
        """Add a lane call's counts to the statistics."""
        ...

    def lane_overrun(self, t0: float) -> bool:
        """Did the lane call begun at ``t0`` pass the deadline (its drafts are then dropped)?"""
        ...

    def on_timeout(self, rows: int) -> None:
        """A step's drafting passed its deadline: ``rows`` drafts were dropped."""
        ...


@runtime_checkable
class StepEngine(Protocol):
    """What ``ProposerCore`` and the modes call on the engine that drafts (see the module docstring)."""

    lane: Lane | None  # the drafter's native lane (token-matrix steps, thread mode), None for the Python engine

    @property
    def request_ids(self) -> Collection[str]:
        """The requests the engine holds, in start order."""
        ...

    def draft_rows(self, batch: StepBatch, *, plan: StepPlan) -> list[list[int]]:
        """One step's drafts per row of ``batch``, after the stops."""
        ...

    def stop(self, request_id: str) -> None:
        """Stop a held request (it restarts from its context if seen again)."""
        ...

    def stop_all(self) -> None:
        """Stop every held request."""
        ...

    def invalidate(self, request_id: str) -> None:
        """The request's next row restarts it from its full context."""
        ...

    def forget_drafts(self, request_ids: Sequence[str]) -> None:
        """These requests' drafts of the last step were withheld: vLLM verifies none of them."""
        ...

    def start_early(self, request_id: str, prompt_ids: Sequence[int], rest_ids: Sequence[int]) -> bool:
        """Start a request not held yet from its context ahead of its row; False if the engine does not."""
        ...

    def refresh_early(self) -> int:
        """Rebuild now what the stops made stale (the next step would); the requests refreshed."""
        ...

    def close(self) -> None:
        """Release what the engine holds (its requests are stopped first)."""
        ...


class LaneEngine:
    """``StepEngine`` on the drafter's native lane: every row's bookkeeping, drafting, cut and padding in one call.
    ``core``: the ``ProposerCore`` that owns it (``StepHost``: its decisions, statistics and deadline)."""

    def __init__(self, core: StepHost, lane: Lane) -> None:
        self.core = core
        self.lane: Lane | None = lane

    @property
    def request_ids(self) -> Collection[str]:
        assert self.lane is not None
        return self.lane.request_ids

    def draft_rows(self, batch: StepBatch, *, plan: StepPlan) -> list[list[int]]:
        """Same drafts as the Python engine. A step over the deadline is dropped (counted); after
        LANE_MAX_OVERRUNS of them the core moves to the Python engine (threaded, deadline-checked)."""
        assert self.lane is not None
        core = self.core
        decisions = core.lane_decisions(plan)
        t0 = core.clock()
        drafts, counts = lane_step(self.lane, batch, decisions=decisions)
        core.count_lane(counts)
        if core.lane_overrun(t0):
            core.on_timeout(sum(1 for d in drafts if d))
            return [[] for _ in drafts]
        return drafts

    def stop(self, request_id: str) -> None:
        assert self.lane is not None
        self.lane.stop(request_id)

    def stop_all(self) -> None:
        if self.lane is not None:
            for rid in list(self.lane.request_ids):
                self.lane.stop(rid)

    def invalidate(self, request_id: str) -> None:
        assert self.lane is not None
        self.lane.lane_invalidate(request_id)

    def forget_drafts(self, request_ids: Sequence[str]) -> None:
        assert self.lane is not None
        self.lane.lane_forget(request_ids)

    def start_early(self, request_id: str, prompt_ids: Sequence[int], rest_ids: Sequence[int]) -> bool:
        assert self.lane is not None
        if request_id in self.lane.request_ids:
            return False
        self.lane.lane_start(request_id, prompt_ids, rest_ids)
        return True

    def refresh_early(self) -> int:
        assert self.lane is not None
        return self.lane.lane_refresh()

    def close(self) -> None:
        self.stop_all()
