"""Per-request bookkeeping and counters of ``specdec.pipeline.AsyncDrafter``.

Epochs: a request's ``epoch`` counts the ``extend`` calls (verification outcomes) seen so far. The
draft handed out at epoch ``e`` is verified by the step whose outcome arrives as extend number
``e + 1``; hedges planned for that outcome are tagged ``e``. A hedge result is kept only if its
request is still at epoch ``e`` (stored in ``hedges``) or has just moved to ``e + 1`` with exactly that
outcome and no draft handed out yet (then it ``resolved`` the step); anything else is stale.
``applied_extends`` counts the extends already applied to the inner drafter: a hedge for epoch ``e``
may only be drafted while it equals ``e`` (the inner state is the context the plan assumed).
All methods are called with ``AsyncDrafter._state`` held.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from specdec.hedge import Outcome
from specdec.tree import TokenTree

Key = tuple[int, ...]  # the tokens one verification step emitted (accepted + bonus)
HIT_EMA_ALPHA = 0.25  # weight of the latest planned step in a request's hit-rate average


@dataclass(eq=False)
class ReqState:
    epoch: int = 0
    started: bool = False  # the inner drafter has seen start()
    applied_extends: int = 0
    cancelled: bool = False
    draft: TokenTree | None = None  # the draft handed out at ``epoch`` (being verified)
    budget: int = 0
    tree: bool = False
    probes: list = field(default_factory=list)  # [(prefix, tree)] of the current plan
    plan: list[Outcome] = field(default_factory=list)
    planned_epoch: int = -1
    in_flight: set[Key] = field(default_factory=set)  # planned outcomes (epoch planned_epoch) not drafted yet
    computing: Key | None = None  # the planned outcome a worker is drafting right now
    hedges: dict[Key, TokenTree] = field(default_factory=dict)  # outcome -> next draft (epoch ``epoch``)
    outcome: Key | None = None  # the latest outcome (extend number ``epoch``)
    outcome_planned: bool = False  # the latest outcome's step had a non-empty hedge plan
    outcome_full: bool = False  # the latest outcome accepted the whole draft (vs a rejection inside it)
    resolved: TokenTree | None = None  # the pre-drafted draft for ``outcome``
    consumed: bool = False
    hit_ema: float = 1.0  # recent hit rate of this request's planned steps
    pause: int = 0  # steps left without hedging (after a run of misses)

    # -------------------------------------------------------------- main thread
    def on_extend(self, key: Key) -> int:
        """Record an outcome; return the number of hedges discarded as stale."""
        stale = len(self.hedges) - (key in self.hedges) + (self.resolved is not None)
        self.resolved = self.hedges.pop(key, None)
        self.hedges.clear()
        self.outcome_planned = self.planned_epoch == self.epoch and bool(self.plan)
        self.outcome_full = self.draft is not None and len(key) > self.draft.max_depth
        self.outcome = key
        self.epoch += 1
        self.consumed = False
        return stale

    def outcome_in_flight(self) -> bool:
        """A worker is drafting the hedge for the latest outcome right now (worth a short wait)."""
        return (self.outcome is not None and self.planned_epoch == self.epoch - 1
                and self.computing == self.outcome)

    def outcome_late(self) -> bool:
        """The latest outcome was planned but its hedge is not drafted (yet)."""
        return (self.outcome is not None and self.planned_epoch == self.epoch - 1
                and self.outcome in self.in_flight)

    def take_resolved(self) -> TokenTree:
        tree, self.resolved, self.consumed = self.resolved, None, True
        assert tree is not None
        return tree

    def on_draft(self, draft: TokenTree, budget: int, tree: bool) -> None:
        """The draft handed out at the current epoch; a new hedge plan will be made for it."""
        self.draft, self.budget, self.tree = draft, budget, tree
        self.plan, self.probes, self.in_flight, self.computing = [], [], set(), None
        self.planned_epoch = -1
        self.outcome, self.outcome_planned, self.consumed = None, False, True

    def observe(self, hit: bool, *, min_hit_rate: float, pause_steps: int) -> None:
        """Track the hit rate of planned steps; hedging pauses while it is below ``min_hit_rate``."""
        self.hit_ema += HIT_EMA_ALPHA * (float(hit) - self.hit_ema)
        if self.hit_ema < min_hit_rate:
            self.pause, self.hit_ema = pause_steps, min_hit_rate  # retry after the pause at the threshold

    # -------------------------------------------------------------- worker
    def current(self, epoch: int) -> bool:
        """The inner drafter's state is this request's context at ``epoch``."""
        return not self.cancelled and self.started and self.applied_extends == epoch

    def plannable(self, epoch: int, rank: int) -> bool:
        if self.cancelled or self.draft is None:
            return False
        if rank == 0:
            return self.epoch == epoch and self.planned_epoch != epoch
        return self.planned_epoch == epoch and rank < len(self.plan)

    def wanted(self, epoch: int, key: Key) -> bool:
        if self.cancelled or self.planned_epoch != epoch:
            return False
        if self.epoch == epoch:
            return key not in self.hedges
        return self.epoch == epoch + 1 and self.outcome == key and self.resolved is None and not self.consumed

    def store(self, epoch: int, key: Key, tree: TokenTree) -> int:
        """Keep a finished hedge if still useful; return 1 if it is stale (discarded), else 0."""
        if self.cancelled:
            return 1
        if self.epoch == epoch:
            self.hedges[key] = tree
            return 0
        if self.epoch == epoch + 1 and self.outcome == key and self.resolved is None and not self.consumed:
            self.resolved = tree
            return 0
        return 1


@dataclass(eq=False)
class Job:
    """One hedge job: the requests of one ``draft_batch`` call, with the epoch of their drafts."""

    entries: list[tuple[str, ReqState, int]]
    deadline: float = float("inf")  # perf_counter time after which hedging would compete with the engine
    ids: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        self.ids = frozenset(rid for rid, _, _ in self.entries)


@dataclass
class AsyncStats:
    """Counters of the pipeline. ``lookups == hits + late_hits + misses`` always holds."""

    lookups: int = 0  # requests asked for a draft
    hits: int = 0  # the pre-drafted hedge was ready
    late_hits: int = 0  # the hedge arrived while waiting (within wait_ms)
    miss_cold: int = 0  # no hedge plan existed for the outcome's step (first step, job not done in time)
    miss_unplanned: int = 0  # a plan existed but the outcome was not among the hedged ones
    miss_late: int = 0  # the outcome was planned but its hedge not ready (in time)
    sync_drafts: int = 0  # misses drafted on the critical path
    miss_no_draft: int = 0  # misses handed out without a draft (on_miss="empty"/"budget")
    jobs: int = 0
    jobs_dropped: int = 0  # bounded queue overflow
    jobs_cut: int = 0  # jobs stopped at their deadline (the next step was due)
    skipped_empty: int = 0  # empty drafts handed out: nothing to plan on
    skipped_paused: int = 0  # requests whose hedges kept missing (paused for a while)
    probes: int = 0
    planned: int = 0  # outcomes planned
    hedges: int = 0  # hedges drafted
    hedges_from_probe: int = 0  # hedges cut from the probe tree (drafter without draft_after)
    stale: int = 0  # hedges drafted but discarded (other outcome, request moved on or stopped)
    hedge_errors: int = 0
    planned_full: int = 0  # planned steps whose outcome accepted the whole draft ...
    planned_full_hits: int = 0  # ... and how many of them hit
    planned_partial: int = 0  # planned steps with a rejection inside the draft ...
    planned_partial_hits: int = 0  # ... and how many of them hit
    critical_seconds: float = 0.0  # main-thread time inside AsyncDrafter (what the engine waits for)
    wait_seconds: float = 0.0  # part of it spent waiting for in-flight hedges
    sync_draft_seconds: float = 0.0  # part of it spent drafting misses
    main_inner_seconds: float = 0.0  # part of it holding (or waiting for) the inner drafter
    background_seconds: float = 0.0  # worker time on jobs (off the critical path)

    @property
    def misses(self) -> int:
        return self.miss_cold + self.miss_unplanned + self.miss_late

    def count_miss(self, req: ReqState | None) -> None:
        if req is not None and req.outcome_late():
            self.miss_late += 1
        elif req is not None and req.outcome_planned:
            self.miss_unplanned += 1
        else:
            self.miss_cold += 1

    def count_outcome(self, req: ReqState, hit: bool) -> None:
        """Hit/miss of a planned step, split by full acceptance vs a rejection inside the draft."""
        if not req.outcome_planned:
            return
        if req.outcome_full:
            self.planned_full += 1
            self.planned_full_hits += hit
        else:
            self.planned_partial += 1
            self.planned_partial_hits += hit

    @property
    def hit_rate(self) -> float:
        return (self.hits + self.late_hits) / self.lookups if self.lookups else 0.0

    @property
    def planned_hit_rate(self) -> float:
        """Hit rate over the lookups whose step had a hedge plan (excludes cold misses)."""
        n = self.lookups - self.miss_cold
        return (self.hits + self.late_hits) / n if n else 0.0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(misses=self.misses, hit_rate=self.hit_rate, planned_hit_rate=self.planned_hit_rate)
        return out
