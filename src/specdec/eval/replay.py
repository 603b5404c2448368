"""Trace replay: simulated greedy verification of any drafter against recorded responses.

Per record: ``drafter.start(id, prompt)``; then per step the drafter drafts a tree (``draft_batch``), the tree is
walked against the true continuation (the longest root path equal to it is accepted), the true next token is
added as the bonus token unless the response is already complete, and ``drafter.extend(id, emitted)`` feeds the
accepted + bonus tokens back; finally ``drafter.stop(id)``. The drafter object (and its global state) persists
across the records of a set, so it is warmed only by earlier records. ``batch_size`` > 1 replays that many
records concurrently (one ``draft_batch`` call per step over all of them), as a server would.

Counts (all summed over the dataset): a step is one draft+verify round of one request; ``emitted`` =
accepted + bonus; MAT = emitted / steps; acceptance rate = accepted / drafted (tree mode: all nodes count as
drafted); ``per_position_drafted[k]`` = steps whose draft reaches depth k+1, ``per_position_accepted[k]`` =
steps that accepted at least k+1 tokens; ``per_position_acceptance[k]`` = their ratio.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specdec.drafters.base import Drafter, DraftRequest
from specdec.eval.records import TraceRecord
from specdec.stats import AcceptanceCounts
from specdec.tree import TokenTree

logger = logging.getLogger("specdec.eval")
US = 1e6
PERCENTILES = (10, 50, 90)
CSV_FIELDS = (
    "record",
    "step",
    "position",
    "context_len",
    "drafted",
    "depth",
    "accepted",
    "emitted",
    "draft_us",
    "update_us",
)


@dataclass
class ReplayResult(AcceptanceCounts):
    """Totals of one replay (one dataset x one drafter setting); ``as_dict()`` is the JSON schema."""

    records: int = 0
    records_skipped_empty: int = 0
    prompt_tokens: int = 0
    response_tokens: int = 0
    steps_with_draft: int = 0
    max_draft: int = 0
    draft_seconds: float = 0.0
    update_seconds: float = 0.0
    start_seconds: float = 0.0
    wall_seconds: float = 0.0
    draft_errors: int = 0
    budget_violations: int = 0
    per_record_mat: list[float] = field(default_factory=list, repr=False)
    outputs: dict[str, list[int]] | None = field(default=None, repr=False)  # emitted tokens per record (opt-in)

    @property
    def drafted_per_step(self) -> float:
        return self.drafted_tokens / self.steps if self.steps else 0.0

    @property
    def accepted_per_step(self) -> float:
        return self.accepted_tokens / self.steps if self.steps else 0.0

    @property
    def draft_us_per_token(self) -> float:
        return self.draft_seconds * US / self.emitted_tokens if self.emitted_tokens else 0.0

    @property
    def update_us_per_token(self) -> float:
        return self.update_seconds * US / self.emitted_tokens if self.emitted_tokens else 0.0

    @property
    def draft_us_per_step(self) -> float:
        return self.draft_seconds * US / self.steps if self.steps else 0.0

    @property
    def start_us_per_prompt_token(self) -> float:
        return self.start_seconds * US / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        q = np.percentile(self.per_record_mat, PERCENTILES).tolist() if self.per_record_mat else []
        return {
            "mat": self.mat,
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance": self.per_position_acceptance,
            "per_position_accepted": list(self.per_position_accepted),
            "per_position_drafted": list(self.per_position_drafted),
            "steps": self.steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "emitted_tokens": self.emitted_tokens,
            "drafted_per_step": self.drafted_per_step,
            "accepted_per_step": self.accepted_per_step,
            "steps_with_draft": self.steps_with_draft,
            "max_draft": self.max_draft,
            "draft_us_per_token": self.draft_us_per_token,
            "update_us_per_token": self.update_us_per_token,
            "draft_us_per_step": self.draft_us_per_step,
            "start_us_per_prompt_token": self.start_us_per_prompt_token,
            "records": self.records,
            "records_skipped_empty": self.records_skipped_empty,
            "prompt_tokens": self.prompt_tokens,
            "response_tokens": self.response_tokens,
            "draft_errors": self.draft_errors,
            "budget_violations": self.budget_violations,
            "wall_seconds": self.wall_seconds,
            "per_record_mat_p10_p50_p90": q,
        }


def accepted_length(tree: TokenTree, continuation: Sequence[int]) -> int:
    """Length of the longest root path of ``tree`` equal to a prefix of ``continuation``."""
    n = len(tree)
    if n == 0 or not len(continuation):
        return 0
    if tree.is_chain():
        k = min(n, len(continuation))
        neq = np.flatnonzero(tree.tokens[:k] != np.asarray(continuation[:k], dtype=np.int64))
        return int(neq[0]) if neq.size else k
    return len(tree.match_length(continuation))


@dataclass
class _Active:
    """A record being replayed: request id, truth [R] (list), position in the response, step count."""

    rid: str
    record: TraceRecord
    truth: list[int]
    pos: int = 0
    steps: int = 0
    emitted: list[int] | None = None


class _Replayer:
    def __init__(
        self, drafter: Drafter, *, budget: int, tree: bool, strict: bool, keep_outputs: bool, writer: Any
    ) -> None:
        self.drafter, self.budget, self.tree, self.strict = drafter, budget, tree, strict
        self.keep_outputs, self.writer = keep_outputs, writer
        self.res = ReplayResult(outputs={} if keep_outputs else None)
        self._logged: set[str] = set()

    def _fail(self, what: str, exc: BaseException) -> None:
        if self.strict:
            raise exc
        self.res.draft_errors += 1
        if what not in self._logged:
            self._logged.add(what)
            logger.warning(
                "drafter %s failed in %s: %r; the step goes on without a draft (counted as draft_errors, logged once)",
                getattr(self.drafter, "name", "?"),
                what,
                exc,
            )

    def start(self, rid: str, rec: TraceRecord) -> _Active:
        t0 = time.perf_counter()
        try:
            self.drafter.start(rid, rec.prompt_list())
        except Exception as exc:  # noqa: BLE001
            self._fail("start", exc)
        self.res.start_seconds += time.perf_counter() - t0
        return _Active(rid, rec, rec.response_list(), emitted=[] if self.keep_outputs else None)

    def draft(self, active: list[_Active]) -> tuple[list[TokenTree], float]:
        reqs = [DraftRequest(a.rid, self.budget, self.tree) for a in active]
        t0 = time.perf_counter()
        try:
            trees = list(self.drafter.draft_batch(reqs))
            if len(trees) != len(reqs):
                raise RuntimeError(f"draft_batch returned {len(trees)} trees for {len(reqs)} requests")
        except Exception as exc:  # noqa: BLE001
            self._fail("draft_batch", exc)
            trees = [TokenTree.empty() for _ in reqs]
        for i, (t, req) in enumerate(zip(trees, reqs)):
            if not isinstance(t, TokenTree):  # None or junk: a drafter failure for that request
                self._fail(
                    "draft_batch",
                    TypeError(
                        f"draft_batch returned {type(t).__name__} for request {req.request_id!r}; expected a TokenTree"
                    ),
                )
                trees[i] = TokenTree.empty()
        dt = time.perf_counter() - t0
        self.res.draft_seconds += dt
        return [self._check(t) for t in trees], dt / max(len(active), 1)

    def _check(self, tree: TokenTree) -> TokenTree:
        bad = len(tree) > self.budget or (not self.tree and len(tree) and not tree.is_chain())
        if not bad:
            return tree
        msg = (
            f"drafter {getattr(self.drafter, 'name', '?')} returned {len(tree)} nodes "
            f"({'tree' if not tree.is_chain() else 'chain'}) for budget {self.budget}, tree={self.tree}"
        )
        if self.strict:
            raise RuntimeError(msg)
        self.res.budget_violations += 1
        if "budget" not in self._logged:
            self._logged.add("budget")
            logger.warning("%s; truncated (counted as budget_violations, logged once)", msg)
        return tree.truncate(self.budget) if self.tree else tree.to_chain(self.budget)

    def step(self, a: _Active, tree: TokenTree, draft_s: float) -> None:
        res, remaining = self.res, len(a.truth) - a.pos
        depth = tree.max_depth
        acc = accepted_length(tree, a.truth[a.pos : a.pos + min(depth, remaining)])
        emit = acc + (1 if acc < remaining else 0)
        out = a.truth[a.pos : a.pos + emit]
        t0 = time.perf_counter()
        try:
            self.drafter.extend(a.rid, out)
        except Exception as exc:  # noqa: BLE001
            self._fail("extend", exc)
        upd = time.perf_counter() - t0
        res.update_seconds += upd
        self._count(tree, depth, acc, emit)
        if self.writer is not None:
            ctx = a.record.prompt_ids.size + a.pos
            self.writer.writerow(
                (a.rid, a.steps, a.pos, ctx, len(tree), depth, acc, emit, f"{draft_s * US:.2f}", f"{upd * US:.2f}")
            )
        if a.emitted is not None:
            a.emitted.extend(out)
        a.pos += emit
        a.steps += 1

    def _count(self, tree: TokenTree, depth: int, acc: int, emit: int) -> None:
        res = self.res
        res.observe(drafted=len(tree), depth=depth, accepted=acc, emitted=emit)
        res.steps_with_draft += bool(len(tree))
        res.max_draft = max(res.max_draft, len(tree))

    def finish(self, a: _Active) -> None:
        try:
            self.drafter.stop(a.rid)
        except Exception as exc:  # noqa: BLE001
            self._fail("stop", exc)
        res = self.res
        res.records += 1
        res.prompt_tokens += int(a.record.prompt_ids.size)
        res.response_tokens += len(a.truth)
        res.per_record_mat.append(len(a.truth) / max(a.steps, 1))
        if res.outputs is not None and a.emitted is not None:
            res.outputs[a.rid] = a.emitted


def _request_ids(records: Sequence[TraceRecord]) -> list[str]:
    """Unique request ids (record ids, suffixed when a set repeats one)."""
    seen: set[str] = set()
    out = []
    for i, r in enumerate(records):
        rid = r.id if r.id not in seen else f"{r.id}#{i}"
        seen.add(rid)
        out.append(rid)
    return out


def replay(
    drafter: Drafter,
    records: Sequence[TraceRecord],
    *,
    budget: int,
    tree: bool,
    progress: bool = False,
    step_csv: str | os.PathLike[str] | None = None,
    batch_size: int = 1,
    strict: bool = False,
    keep_outputs: bool = False,
    desc: str = "replay",
) -> ReplayResult:
    """Replay ``records`` in order through ``drafter`` (see the module docstring) -> totals.

    ``budget``: max draft tokens per request per step; ``tree``: allow tree drafts (else chains). Drafter
    failures are absorbed (empty draft for the step, counted in ``draft_errors``) unless ``strict``.
    ``step_csv``: write one row per step (columns ``CSV_FIELDS``), atomically at the end.
    ``keep_outputs``: keep the emitted tokens per request id in ``result.outputs`` (for checks).
    """
    if budget < 0:
        raise ValueError(f"budget={budget} must be >= 0")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    tmp = None
    writer = None
    with contextlib.ExitStack() as closing:  # on the way out: the progress bar, then the CSV file
        if step_csv is not None:
            tmp = f"{step_csv}.{os.getpid()}.tmp"
            writer = csv.writer(closing.enter_context(open(tmp, "w", newline="", encoding="utf-8")))
            writer.writerow(CSV_FIELDS)
        rp = _Replayer(drafter, budget=budget, tree=tree, strict=strict, keep_outputs=keep_outputs, writer=writer)
        bar = _bar(records, progress, desc)
        if bar is not None:
            closing.callback(bar.close)
        t_wall = time.perf_counter()
        _run(rp, records, batch_size, bar)
    rp.res.wall_seconds = time.perf_counter() - t_wall
    if tmp is not None:
        os.replace(tmp, step_csv)
    return rp.res


def _run(rp: _Replayer, records: Sequence[TraceRecord], batch_size: int, bar: Any) -> None:
    queue = deque(zip(_request_ids(records), records))
    active: list[_Active] = []
    while queue or active:
        while queue and len(active) < batch_size:
            rid, rec = queue.popleft()
            if rec.response_ids.size == 0:
                rp.res.records_skipped_empty += 1
                continue
            active.append(rp.start(rid, rec))
        if not active:
            break
        trees, per_req_s = rp.draft(active)
        for a, t in zip(active, trees):
            before = a.pos
            rp.step(a, t, per_req_s)
            if bar is not None:
                bar.update(a.pos - before)
        done = [a for a in active if a.pos >= len(a.truth)]
        for a in done:
            rp.finish(a)
        if done:
            active = [a for a in active if a.pos < len(a.truth)]


def _bar(records: Sequence[TraceRecord], enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    total = sum(int(r.response_ids.size) for r in records)
    return tqdm(total=total, desc=desc, unit="tok", leave=False, dynamic_ncols=True)
