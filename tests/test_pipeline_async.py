"""AsyncDrafter bookkeeping under a simulated verifier: lossless, same drafts as synchronous drafting,
hedge hits, misses, out-of-order completions, aborts, errors and deadlines."""
from __future__ import annotations

import random
import time

import numpy as np
import pytest

from pipeline_toys import LookupDrafter, ToyTarget
from specdec.drafters.base import DraftRequest
from specdec.hedge import rank_outcomes
from specdec.pipeline import AsyncConfig, AsyncDrafter
from specdec.pipeline_state import ReqState
from specdec.tree import TokenTree

GPU_S = 0.002  # simulated verification time per step (the worker drafts meanwhile)


def greedy(target: ToyTarget, prompt: list[int], n: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(target.next_token(ctx))
    return ctx[len(prompt):]


def prompts(seed: int, count: int, length: int = 8) -> dict[str, list[int]]:
    rs = random.Random(seed)
    return {f"r{i}": [rs.randrange(12) for _ in range(length)] for i in range(count)}


def simulate(drafter, target, reqs: dict[str, list[int]], *, max_new: int, budget: int, tree: bool,
             reference: LookupDrafter | None = None, gpu_s: float = GPU_S) -> dict[str, list[int]]:
    """Batched generation: draft -> (simulated GPU) verify -> extend; stop when done.

    With ``reference`` (a synchronous twin fed the same calls), every handed-out draft must equal it.
    """
    out = {rid: [] for rid in reqs}
    ctx = {rid: list(p) for rid, p in reqs.items()}
    for rid, p in reqs.items():
        drafter.start(rid, p)
        if reference:
            reference.start(rid, p)
    active = list(reqs)
    while active:
        batch = [DraftRequest(rid, budget, tree) for rid in active]
        drafts = drafter.draft_batch(batch)
        if reference:
            for d, want in zip(drafts, reference.draft_batch(batch)):
                assert d.as_lists() == want.as_lists()
        time.sleep(gpu_s)
        for rid, d in zip(list(active), drafts):
            assert len(d) <= budget and (tree or d.is_chain())
            emitted = target.verify(ctx[rid], d)[: max_new - len(out[rid])]
            ctx[rid] += emitted
            out[rid] += emitted
            drafter.extend(rid, emitted)
            if reference:
                reference.extend(rid, emitted)
            if len(out[rid]) >= max_new:
                drafter.stop(rid)
                if reference:
                    reference.stop(rid)
                active.remove(rid)
    return out


def check_stats(d: AsyncDrafter) -> dict:
    s = d.stats
    assert s.lookups == s.hits + s.late_hits + s.misses
    assert s.sync_drafts + s.miss_no_draft == s.misses
    if d.config.on_miss == "sync":
        assert s.miss_no_draft == 0
    assert s.hedges >= s.hits + s.late_hits
    assert s.critical_seconds >= s.wait_seconds
    return s.as_dict()


@pytest.mark.parametrize("tree", [False, True])
def test_async_is_lossless_and_drafts_like_sync(tree: bool) -> None:
    target = ToyTarget(seed=1)
    reqs = prompts(2, 4)
    d = AsyncDrafter(LookupDrafter(), hedge_width=6, window_frac=0.0, min_hit_rate=0.0)  # no timing heuristics
    try:
        out = simulate(d, target, reqs, max_new=60, budget=6, tree=tree, reference=LookupDrafter())
    finally:
        d.close()
    for rid, p in reqs.items():
        assert out[rid] == greedy(target, p, 60)
    stats = check_stats(d)
    # cold misses here are steps after an empty draft (nothing to hedge on); planned steps mostly hit
    assert stats["hits"] + stats["late_hits"] >= 10 and stats["planned_hit_rate"] > 0.7, stats
    assert d.inner.active_requests() == [] and d.active_requests() == []


def test_out_of_order_completions_many_workers() -> None:
    target = ToyTarget(seed=3)
    reqs = prompts(4, 5)
    d = AsyncDrafter(LookupDrafter(delay_s=0.0008, seed=5), num_workers=3, hedge_width=5, max_jobs=1,
                     window_frac=0.0, min_hit_rate=0.0)
    try:
        out = simulate(d, target, reqs, max_new=40, budget=5, tree=False, reference=LookupDrafter())
    finally:
        d.close()
    for rid, p in reqs.items():
        assert out[rid] == greedy(target, p, 40)
    stats = check_stats(d)
    assert stats["hedges"] > 0 and stats["hits"] + stats["late_hits"] > 0, stats


def test_req_state_keeps_only_current_hedges() -> None:
    """Out-of-order and late completions: a hedge counts only for its epoch or as that epoch's outcome."""
    t1, t2, t3 = TokenTree.chain([1]), TokenTree.chain([2]), TokenTree.chain([3])
    st = ReqState(started=True)
    st.on_draft(TokenTree.chain([7, 8]), 4, False)
    st.planned_epoch, st.in_flight = 0, {(1,), (2, 3), (4,)}
    assert st.current(0) and st.wanted(0, (1,))
    assert st.store(0, (1,), t1) == 0 and not st.wanted(0, (1,))  # stored, not wanted twice
    assert st.store(0, (4,), t3) == 0
    assert st.on_extend((2, 3)) == 2  # both stored hedges are for other outcomes: stale
    assert st.epoch == 1 and st.resolved is None and st.outcome_late() and not st.outcome_in_flight()
    st.computing = (2, 3)  # a worker is drafting it: worth waiting for
    assert st.outcome_in_flight()
    assert not st.wanted(0, (1,)) and st.wanted(0, (2, 3))
    assert st.store(0, (1,), t1) == 1  # a late completion of another outcome: stale
    assert st.store(0, (2, 3), t2) == 0 and st.take_resolved() is t2  # late hit
    assert st.store(0, (2, 3), t2) == 1  # a duplicate after consumption: stale
    st.on_draft(t2, 4, False)  # epoch 1's draft handed out
    assert st.store(0, (2, 3), t2) == 1 and not st.outcome_in_flight()
    assert st.current(0) and not st.current(1)  # inner state reaches epoch 1 when the extend is applied
    st.applied_extends = 1
    assert st.current(1)
    st.cancelled = True
    assert st.store(1, (5,), t1) == 1 and not st.current(1) and not st.plannable(1, 0)


def test_aborts_and_restarts_keep_inner_state_exact() -> None:
    target = ToyTarget(seed=4)
    rs = random.Random(0)
    d = AsyncDrafter(LookupDrafter(delay_s=0.0003), hedge_width=4)
    ctx: dict[str, list[int]] = {}
    try:
        for step in range(120):
            if len(ctx) < 4 or rs.random() < 0.1:  # (re)start a request, possibly reusing an id
                rid = f"q{rs.randrange(6)}"
                ctx[rid] = [rs.randrange(12) for _ in range(6)]
                d.start(rid, ctx[rid])
            if rs.random() < 0.08:  # abort one
                rid = rs.choice(sorted(ctx))
                d.stop(rid)
                del ctx[rid]
                continue
            ids = sorted(ctx)
            drafts = d.draft_batch([DraftRequest(r, 4) for r in ids])
            time.sleep(0.001 * rs.random())
            for rid, dr in zip(ids, drafts):
                emitted = target.verify(ctx[rid], dr)
                ctx[rid] += emitted
                d.extend(rid, emitted)
        d.flush()
        assert sorted(d.inner.contexts) == sorted(ctx) == sorted(d.active_requests())
        for rid, c in ctx.items():
            assert d.inner.contexts[rid] == c
    finally:
        d.close()
    check_stats(d)


def test_on_miss_empty_never_drafts_on_the_critical_path() -> None:
    target = ToyTarget(seed=5)
    reqs = prompts(6, 3)
    d = AsyncDrafter(LookupDrafter(), on_miss="empty", hedge_width=6, window_frac=0.0, min_hit_rate=0.0)
    try:
        out = simulate(d, target, reqs, max_new=50, budget=6, tree=False)
    finally:
        d.close()
    for rid, p in reqs.items():
        assert out[rid] == greedy(target, p, 50)
    stats = check_stats(d)
    assert stats["sync_drafts"] == 0 and stats["sync_draft_seconds"] == 0.0
    assert stats["hits"] > 0, stats


def test_never_stalls_behind_a_slow_drafter() -> None:
    """With on_miss='empty', the critical path never waits for the (busy) inner drafter."""
    target = ToyTarget(seed=6)
    d = AsyncDrafter(LookupDrafter(delay_s=0.1, seed=1), on_miss="empty", wait_ms=1.0, hedge_width=8)
    ctx = {"a": [1, 2, 3, 1, 2, 3, 1, 2]}
    d.start("a", ctx["a"])
    worst = 0.0
    try:
        for _ in range(15):
            t0 = time.perf_counter()
            dr = d.draft_batch([DraftRequest("a", 4)])[0]
            worst = max(worst, time.perf_counter() - t0)
            emitted = target.verify(ctx["a"], dr)
            ctx["a"] += emitted
            t0 = time.perf_counter()
            d.extend("a", emitted)
            worst = max(worst, time.perf_counter() - t0)
    finally:
        d.close()
    assert worst < 0.05, worst  # well under one drafter call (up to 100 ms, 50 ms on average)
    check_stats(d)


def test_drafter_errors_are_absorbed() -> None:
    target = ToyTarget(seed=7)
    reqs = prompts(8, 3)
    d = AsyncDrafter(LookupDrafter(fail_every=5), hedge_width=3)
    try:
        out = simulate(d, target, reqs, max_new=40, budget=5, tree=False)
    finally:
        d.close()
    for rid, p in reqs.items():
        assert out[rid] == greedy(target, p, 40)
    check_stats(d)
    assert d.stats.hedge_errors + d.guard.stats.errors > 0


def test_drafter_without_draft_after_hedges_from_probe() -> None:
    target = ToyTarget(seed=8)
    reqs = prompts(9, 3)
    d = AsyncDrafter(LookupDrafter(supports_after=False), hedge_width=4, probe_budget=64, window_frac=0.0,
                     min_hit_rate=0.0)
    try:
        out = simulate(d, target, reqs, max_new=50, budget=4, tree=False)
    finally:
        d.close()
    for rid, p in reqs.items():
        assert out[rid] == greedy(target, p, 50)
    stats = check_stats(d)
    assert stats["hedges_from_probe"] > 0 and stats["hits"] + stats["late_hits"] > 0, stats


def test_no_hedging_is_the_synchronous_path() -> None:
    target = ToyTarget(seed=9)
    reqs = prompts(10, 2)
    d = AsyncDrafter(LookupDrafter(), hedge_width=0)
    out = simulate(d, target, reqs, max_new=30, budget=4, tree=False, reference=LookupDrafter(), gpu_s=0.0)
    d.close()
    assert out == {rid: greedy(target, p, 30) for rid, p in reqs.items()}
    assert d.stats.misses == d.stats.lookups == d.stats.sync_drafts and d.stats.jobs == 0


def test_rank_outcomes_hand_checked() -> None:
    draft = TokenTree.chain([5, 6], [0.8, 0.5])
    # probe: after [] -> 5 (0.8) or 7 (0.2); after [5] -> 6 (0.5) or 9 (0.5); after [5, 6] -> 3 (1.0)
    probe = TokenTree(np.array([5, 7, 6, 9, 3]), np.array([-1, -1, 0, 0, 2]), [0.8, 0.2, 0.5, 0.5, 1.0])
    got = rank_outcomes(draft, [((), probe)], max_outcomes=5)
    scores = {o.emitted: round(o.score, 6) for o in got}
    # P(stop at root)=0.2, bonus 7 (only alternative); P(reach 5)=0.8, stop 0.5, bonus 9;
    # P(reach 5,6)=0.4, leaf stop 1.0, bonus 3.
    assert scores == {(7,): 0.2, (5, 9): 0.4, (5, 6, 3): 0.4}
    assert [o.emitted for o in got][0] == (5, 9)  # ties broken by shorter emitted first
    assert rank_outcomes(draft, [((), probe)], max_outcomes=1)[0].emitted == (5, 9)
    # a leaf probe (drafted after the whole chain) adds the bonus candidates after full acceptance
    leaf = TokenTree(np.array([3, 4]), np.array([-1, -1]), [0.75, 0.25])
    got = {o.emitted: round(o.score, 6) for o in rank_outcomes(draft, [((), probe), ((5, 6), leaf)], max_outcomes=9)}
    assert got == {(7,): 0.2, (5, 9): 0.4, (5, 6, 3): 0.3, (5, 6, 4): 0.1}
    assert rank_outcomes(TokenTree.empty(), [((), TokenTree.empty())], max_outcomes=3) == []


def test_config_rejects_bad_values() -> None:
    from specdec.config import ConfigError

    with pytest.raises(ConfigError, match="on_miss"):
        AsyncConfig.from_dict({"on_miss": "wait"})
    with pytest.raises(ConfigError, match="hedge_widht"):
        AsyncConfig.from_dict({"hedge_widht": 3})


def test_postprocess_shapes_what_is_planned() -> None:
    """A consumer that cuts drafts (vLLM's probability cut) does it through ``postprocess``: the cut draft is
    handed out and hedges are planned for it (so the outcomes of cut drafts still hit)."""
    target = ToyTarget(seed=1)
    reqs = prompts(2, 4)
    cut = lambda t, r: t.truncate(2)  # noqa: E731
    d = AsyncDrafter(LookupDrafter(), hedge_width=6, window_frac=0.0, min_hit_rate=0.0)
    d.postprocess = cut
    try:
        out = simulate(d, target, reqs, max_new=60, budget=6, tree=False, reference=None)
    finally:
        d.close()
    assert out == {rid: greedy(target, p, 60) for rid, p in reqs.items()}
    stats = check_stats(d)
    assert stats["planned_hit_rate"] > 0.7, stats


def test_hedge_snapshot_matches_the_next_lookup() -> None:
    """The snapshot (for a device-side lookup) holds exactly the draft the host lookup hands out on a hit."""
    ctx = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    d = AsyncDrafter(LookupDrafter(n=2), hedge_width=8, window_frac=0.0)
    d.start("a", ctx)
    try:
        assert len(d.draft_batch([DraftRequest("a", 3)])[0]) == 3
        deadline = time.perf_counter() + 5.0
        while d.stats.hedges < 1 and time.perf_counter() < deadline:
            time.sleep(0.002)
        time.sleep(0.05)
        snap = d.hedge_snapshot(["a", "unknown"])
        assert snap[1] == {} and len(snap[0]) >= 1
        key = next(iter(snap[0]))
        d.extend("a", list(key))
        nxt = d.draft_batch([DraftRequest("a", 3)])[0]
        assert d.stats.hits == 1 and nxt.tokens.tolist() == snap[0][key]
    finally:
        d.close()


def test_requests_whose_hedges_keep_missing_pause_hedging() -> None:
    st = ReqState()
    for _ in range(3):
        st.observe(False, min_hit_rate=0.5, pause_steps=4)
    assert st.pause == 4 and st.hit_ema == 0.5  # paused; resumes at the threshold, so one hit keeps it going
    st.pause = 0
    st.observe(True, min_hit_rate=0.5, pause_steps=4)
    assert st.pause == 0 and st.hit_ema > 0.5
    # in the pipeline: a drafter whose hedges never hit (its probes predict wrong bonus tokens) stops being
    # hedged most of the time

    class WrongProbes(LookupDrafter):
        def draft_after(self, request_id, extra_tokens, budget, *, tree=False):  # type: ignore[no-untyped-def]
            t = super().draft_after(request_id, extra_tokens, budget, tree=tree)
            if t is None or not len(t):
                return TokenTree.chain([99])
            return TokenTree(t.tokens + 100, t.parents, t.probs)

    target = ToyTarget(seed=11)
    reqs = prompts(12, 2)
    d = AsyncDrafter(WrongProbes(), hedge_width=2, min_hit_rate=0.5, pause_steps=8)
    try:
        out = simulate(d, target, reqs, max_new=60, budget=4, tree=False, gpu_s=0.0005)
    finally:
        d.close()
    assert out == {rid: greedy(target, p, 60) for rid, p in reqs.items()}
    check_stats(d)
    assert d.stats.hits == 0 and d.stats.miss_unplanned > 0 and d.stats.skipped_paused > 0, d.stats


def test_budget_mode_bounds_the_critical_path() -> None:
    """on_miss='budget': misses are drafted synchronously only within miss_budget_us per call."""
    target = ToyTarget(seed=13)
    reqs = prompts(14, 16)
    slow = LookupDrafter(delay_s=0.002, seed=3)  # up to 2 ms per call; chunks of 4 misses per call
    d = AsyncDrafter(slow, on_miss="budget", miss_budget_us=500.0, hedge_width=0)
    try:
        out = simulate(d, target, reqs, max_new=12, budget=4, tree=False, gpu_s=0.0)
    finally:
        d.close()
    assert out == {rid: greedy(target, p, 12) for rid, p in reqs.items()}
    stats = check_stats(d)
    assert stats["miss_no_draft"] > 0 and stats["sync_drafts"] > 0, stats


def test_switch_interval_is_restored_after_jobs() -> None:
    import sys

    before = sys.getswitchinterval()
    target = ToyTarget(seed=15)
    reqs = prompts(16, 4)
    d = AsyncDrafter(LookupDrafter(delay_s=0.0005), num_workers=3, job_switch_interval_us=150)
    try:
        simulate(d, target, reqs, max_new=30, budget=4, tree=False)
    finally:
        d.close()
    assert sys.getswitchinterval() == before
