"""Many drafter settings in one trace replay: the points of ``specdec-eval curve``.

A replayed context is always the true response so far, so a drafter's state at a response position does not depend
on the drafts made before it. Settings that differ only in a drafter's ``draft_options`` (and the budget and tree
flag) therefore share one drafter object: the replay walks each record once, extends the drafter up to the next
position some setting drafts at, and there drafts for every setting due (giving the drafter that setting's config).
Each setting's counts equal those of its own ``replay`` (tests check it); the cost of starting the requests (most of
an agent trace's replay) is paid once per group instead of once per setting.

``split`` keeps the counts of half the records (``even`` / ``odd``: parity of the SHA-1 of the record id) while
every record still passes through the drafter, so both halves see the same caches: tune on one half, report on the
other. Update time is shared by a group and is not reported per setting (``update_us_per_token`` is 0).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec.drafters.base import Drafter, DraftRequest
from specdec.eval.records import TraceRecord
from specdec.eval.replay import ReplayResult, accepted_length
from specdec.eval.settings import Setting

SPLITS = ("all", "even", "odd")


def record_half(record_id: str) -> str:
    """``even`` or ``odd``: the parity of the SHA-1 of the record id (stable across runs and machines)."""
    return "odd" if hashlib.sha1(record_id.encode("utf-8")).digest()[-1] & 1 else "even"


def in_split(record_id: str, split: str) -> bool:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {', '.join(SPLITS)}")
    return split == "all" or record_half(record_id) == split


def group_settings(settings: Sequence[Setting], draft_options: Callable[[str], frozenset[str]]) -> list[list[int]]:
    """Indices of ``settings`` in groups that can share one drafter: one drafter name, equal options outside that
    drafter's ``draft_options`` (compositions never share)."""
    groups: dict[Any, list[int]] = {}
    for i, s in enumerate(settings):
        if len(s.names) != 1:
            groups[("own", i)] = [i]
            continue
        name = s.names[0]
        free = draft_options(name)
        build = tuple(sorted((k, repr(v)) for k, v in s.options.get(name, {}).items() if k not in free))
        groups.setdefault((name, build), []).append(i)
    return list(groups.values())


@dataclass
class _Lane:
    """One setting's walk through the current record."""

    config: Any
    budget: int
    tree: bool
    res: ReplayResult = field(default_factory=ReplayResult)
    pos: int = 0
    steps: int = 0


def replay_settings(
    drafter: Drafter,
    configs: Sequence[Any],
    settings: Sequence[Setting],
    records: Sequence[TraceRecord],
    *,
    split: str = "all",
    progress: Callable[[int], None] | None = None,
) -> list[ReplayResult]:
    """Replay ``records`` once through ``drafter`` for every setting (``configs[i]``: the drafter config of
    ``settings[i]``; None: the drafter's own) -> one result per setting (see the module docstring)."""
    lanes = [
        _Lane(c if c is not None else getattr(drafter, "config", None), s.budget, s.tree)
        for c, s in zip(configs, settings)
    ]
    t_wall = time.perf_counter()
    seen: set[str] = set()
    for i, rec in enumerate(records):
        rid = rec.id if rec.id not in seen else f"{rec.id}#{i}"
        seen.add(rid)
        if rec.response_ids.size == 0:
            for lane in lanes:
                lane.res.records_skipped_empty += 1
            continue
        _record(drafter, lanes, rid, rec, counted=in_split(rec.id, split))
        if progress is not None:
            progress(int(rec.response_ids.size))
    wall = time.perf_counter() - t_wall
    for lane in lanes:
        lane.res.wall_seconds = wall
    return [lane.res for lane in lanes]


def _record(drafter: Drafter, lanes: Sequence[_Lane], rid: str, rec: TraceRecord, *, counted: bool) -> None:
    """One record: every lane steps through the response; the drafter is extended only as far as the next step."""
    truth = rec.response_list()
    n = len(truth)
    drafter.start(rid, rec.prompt_list())
    done = 0  # response tokens the drafter has seen
    if counted:
        for lane in lanes:
            lane.pos = lane.steps = 0
        while True:
            due = min((lane.pos for lane in lanes if lane.pos < n), default=n)
            if due >= n:
                break
            if due > done:
                drafter.extend(rid, truth[done:due])
                done = due
            for lane in lanes:
                if lane.pos == due:
                    _step(drafter, lane, rid, truth)
        for lane in lanes:
            _finish(lane, rec, n)
    if done < n:
        drafter.extend(rid, truth[done:])
    drafter.stop(rid)


def _step(drafter: Drafter, lane: _Lane, rid: str, truth: list[int]) -> None:
    if lane.config is not None:
        drafter.config = lane.config  # type: ignore[attr-defined] # differs only in the drafter's draft_options
    t0 = time.perf_counter()
    tree = drafter.draft_batch([DraftRequest(rid, lane.budget, lane.tree)])[0]
    lane.res.draft_seconds += time.perf_counter() - t0
    if len(tree) > lane.budget or (not lane.tree and len(tree) and not tree.is_chain()):
        raise RuntimeError(
            f"drafter {drafter.name} returned {len(tree)} nodes for budget {lane.budget}, tree={lane.tree}"
        )
    remaining = len(truth) - lane.pos
    depth = tree.max_depth
    acc = accepted_length(tree, truth[lane.pos : lane.pos + min(depth, remaining)])
    emit = acc + (1 if acc < remaining else 0)
    res = lane.res
    res.observe(drafted=len(tree), depth=depth, accepted=acc, emitted=emit)
    res.steps_with_draft += bool(len(tree))
    res.max_draft = max(res.max_draft, len(tree))
    lane.pos += emit
    lane.steps += 1


def _finish(lane: _Lane, rec: TraceRecord, n: int) -> None:
    res = lane.res
    res.records += 1
    res.prompt_tokens += int(rec.prompt_ids.size)
    res.response_tokens += n
    res.per_record_mat.append(n / max(lane.steps, 1))
