"""The proposer's one-call step: every row's bookkeeping, drafting, cut and padding in one native call.

``ProposerCore``'s Python path costs ~10 us per row and step (0.6-0.9 ms per step at batch 64), all of it GPU idle
time in vLLM 0.26, which drafts on the engine's critical path. A drafter that offers a *lane* (``native_lane()``:
the native suffix drafter) keeps the per-request statistics itself (context length known, last draft,
calibration sums) and runs the whole step for all rows in C++ (``csrc/suffix_lane.inc``). Python keeps the
rare events (start, resync, stop) and the per-step decisions (spec or plain window, cost-model value, padding).

Same drafts, same statistics as the Python path (``tests/test_vllm_lane.py`` runs both over recorded traces with
moving rows, finished requests, resyncs and padding). Switched by the ``native_step`` option (default on); used
with ``deadline_mode="auto"`` only (a step runs inline: one that overruns ``draft_timeout_ms`` is dropped and
counted; after ``LANE_MAX_OVERRUNS`` of them the proposer falls back to the threaded Python path for good).
Calibrated chains (the suffix drafter's ``min_confidence`` > 0) draft on the lane too: it learns the calibration
from every row's tokens as the library's extend does, the library's drafts after the same appends
(``tests/test_suffix_lane_calib.py``; the Python path's too while no request resyncs: a resync's stop is ordered
differently relative to the other rows' extends there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from specdec.drafters.suffix_lane import LaneDecisions
from specdec.vllm_plugin.core.adaptive import MAX_CUT
from specdec.vllm_plugin.core.batch import StepBatch

CALIB_DECAY = 0.8  # decay of a request's predicted / accepted sums (calibration), per step
MIN_CALIBRATION_MASS = 3.0  # predicted tokens before a request's calibration is used
MIN_CALIBRATION, MAX_CALIBRATION = 0.05, 1.5


class Lane(Protocol):
    """What a drafter offers for the one-call step (``SuffixDrafter`` with the native backend)."""

    request_ids: dict[str, int]

    def lane_config(self, **constants: Any) -> None: ...
    def lane_restart(
        self, request_id: str, prompt_ids: Sequence[int], rest_ids: Sequence[int], n_known: int
    ) -> None: ...
    def lane_start(self, request_id: str, prompt_ids: Sequence[int], rest_ids: Sequence[int]) -> None: ...
    def lane_invalidate(self, request_id: str) -> None: ...
    def lane_forget(self, request_ids: Sequence[str]) -> None: ...
    def lane_threads(self, n: int) -> None: ...
    def lane_refresh(self) -> int: ...
    def lane_step(
        self, req_ids: Sequence[str], sampled: Sequence[Sequence[int]], lengths: Any, *, decisions: LaneDecisions
    ) -> tuple[list[list[int]], list[int], int, int]: ...
    def lane_step_tokens(
        self,
        req_ids: Sequence[str],
        tokens: Any,
        known: Sequence[int],
        fillers: Sequence[int],
        out: Any,
        *,
        decisions: LaneDecisions,
    ) -> tuple[list[int] | None, list[int], int, int]: ...
    def stop(self, request_id: str) -> None: ...


def find_lane(drafter: Any) -> Lane | None:
    """The drafter's lane, or None (no native one-call step: the Python path runs)."""
    get = getattr(drafter, "native_lane", None)
    lane = get() if callable(get) else None
    if lane is not None:
        lane.lane_config(
            calib_decay=CALIB_DECAY,
            min_calib_mass=MIN_CALIBRATION_MASS,
            min_calib=MIN_CALIBRATION,
            max_calib=MAX_CALIBRATION,
            max_cut=MAX_CUT,
        )
    return lane


class LaneCounts:
    """What one lane step reports back to the proposer's statistics."""

    __slots__ = ("accepted", "drafted", "started", "resyncs")

    def __init__(self) -> None:
        self.accepted = self.drafted = self.started = self.resyncs = 0


def lane_step(lane: Lane, batch: StepBatch, *, decisions: LaneDecisions) -> tuple[list[list[int]], LaneCounts]:
    """One proposer step over the batch's rows (one native call; two when a row must restart, from its context in
    the batch). ``decisions``: the step's (k, max_model_len, spec, pad, adaptive, ...)."""
    rows = batch.rows
    ids = batch.req_ids if len(batch.req_ids) == rows else batch.req_ids[:rows]
    drafts, redo, accepted, drafted = lane.lane_step(ids, batch.sampled, batch.num_tokens, decisions=decisions)
    counts = LaneCounts()
    counts.accepted, counts.drafted = accepted, drafted
    if not redo:
        return drafts, counts

    _restart_rows(lane, ids, redo, batch.context, counts)
    # the first call changed nothing; the restarted rows are fresh (they hold their tokens): this call extends the
    # others and drafts every row
    drafts, again, acc2, counts.drafted = lane.lane_step(ids, batch.sampled, batch.num_tokens, decisions=decisions)
    if again:  # cannot happen: each was just restarted at exactly this length
        raise RuntimeError(f"lane: rows {again} still out of step after a restart")
    counts.accepted += acc2
    return drafts, counts


def lane_step_tokens(
    lane: Lane,
    req_ids: Sequence[str],
    tokens: np.ndarray,
    known: Sequence[int],
    fillers: Sequence[int],
    out: np.ndarray,
    *,
    context: Callable[[int], tuple[list[int], int]],
    decisions: LaneDecisions,
) -> tuple[list[int], LaneCounts]:
    """``lane_step`` for schedule mode's rows as captured: ``tokens`` [>= rows, w] int32 (-1 = rejected), ``known``
    [rows] context lengths before them, ``fillers`` [rows] last tokens before them; the padded drafts go straight
    into ``out`` [>= rows, width] int32 and their lengths come back (one native call; two when a row must restart).
    ``context(i)``: row i's whole context after its new tokens and its prompt length, for a restart."""
    lengths, redo, accepted, drafted = lane.lane_step_tokens(req_ids, tokens, known, fillers, out, decisions=decisions)
    counts = LaneCounts()
    counts.accepted, counts.drafted = accepted, drafted
    if not redo:
        return lengths, counts
    _restart_rows(lane, req_ids, redo, context, counts)
    lengths, again, acc2, counts.drafted = lane.lane_step_tokens(
        req_ids, tokens, known, fillers, out, decisions=decisions
    )
    if again:  # cannot happen: each was just restarted at exactly this length
        raise RuntimeError(f"lane: rows {again} still out of step after a restart")
    counts.accepted += acc2
    return lengths, counts


def _restart_rows(
    lane: Lane,
    req_ids: Sequence[str],
    redo: Sequence[int],
    context: Callable[[int], tuple[list[int], int]],
    counts: LaneCounts,
) -> None:
    """Restart the rows ``redo`` (new requests, preempted ones coming back, contexts that jumped) from their
    context (``context(i)``: row i's tokens after its new ones and its prompt length); the next lane call drafts."""
    known = lane.request_ids
    for i in redo:
        rid = req_ids[i]
        ctx, p = context(i)
        counts.resyncs += rid in known
        counts.started += 1
        lane.lane_restart(rid, ctx[:p], ctx[p:], len(ctx))
