"""Randomized stress test of AsyncDrafter (seeded, bounded time): random configs, batch compositions,
budgets, tree/chain requests, aborts and restarts, slow and failing drafters. Invariants: output is the
target's greedy output, drafts fit their request, counters add up, inner state equals the true contexts."""
from __future__ import annotations

import random
import sys
import time

import pytest

from pipeline_toys import LookupDrafter, ToyTarget
from specdec.drafters.base import DraftRequest
from specdec.pipeline import AsyncDrafter

TIME_LIMIT_S = 25.0  # all seeds together
SEEDS = range(8)


def _config(rs: random.Random) -> dict:
    return {
        "hedge_width": rs.choice([0, 1, 3, 8]),
        "bonus_per_path": rs.choice([1, 2, 4]),
        "probe_budget": rs.choice([4, 16, 64]),
        "wait_ms": rs.choice([0.0, 0.5, 3.0]),
        "on_miss": rs.choice(["sync", "empty", "budget"]),
        "miss_budget_us": rs.choice([0.0, 300.0, 5000.0]),
        "window_frac": rs.choice([0.0, 0.8, 3.0]),
        "max_jobs": rs.choice([1, 2, 8]),
        "num_workers": rs.choice([1, 2, 3]),
        "defer_updates": rs.choice([True, False]),
        "gate_ms": rs.choice([0.0, 0.0, 1.0]),
        "min_hit_rate": rs.choice([0.0, 0.1, 0.6]),
        "pause_steps": rs.choice([0, 4]),
    }


def _episode(seed: int, deadline: float) -> None:
    interval = sys.getswitchinterval()
    rs = random.Random(seed)
    target = ToyTarget(seed=seed)
    inner = LookupDrafter(n=rs.choice([1, 2, 3]), delay_s=rs.choice([0.0, 0.0002, 0.001]), seed=seed,
                          fail_every=rs.choice([0, 0, 11]), supports_after=rs.random() < 0.8)
    d = AsyncDrafter(inner, **_config(rs))
    ctx: dict[str, list[int]] = {}
    start_len: dict[str, int] = {}
    try:
        for step in range(rs.randrange(30, 90)):
            if time.perf_counter() > deadline:
                break
            for _ in range(rs.choice([0, 0, 1, 2])):  # new or restarted requests (ids are reused)
                rid = f"s{rs.randrange(8)}"
                ctx[rid] = [rs.randrange(12) for _ in range(rs.randrange(1, 10))]
                start_len[rid] = len(ctx[rid])
                d.start(rid, ctx[rid])
            for rid in [r for r in sorted(ctx) if rs.random() < 0.05]:  # aborts
                d.stop(rid)
                del ctx[rid]
            ids = [r for r in sorted(ctx) if rs.random() < 0.9]  # some rows skip a step
            reqs = [DraftRequest(r, rs.randrange(0, 9), rs.random() < 0.3) for r in ids]
            drafts = d.draft_batch(reqs)
            assert len(drafts) == len(reqs)
            time.sleep(rs.choice([0.0, 0.0005, 0.002]))  # simulated GPU time
            for r, dr in zip(reqs, drafts):
                assert len(dr) <= r.budget and (r.tree or dr.is_chain())
                emitted = target.verify(ctx[r.request_id], dr)
                ctx[r.request_id] += emitted
                d.extend(r.request_id, emitted)
        d.flush()
        assert sorted(d.active_requests()) == sorted(ctx) == sorted(inner.contexts)
        for rid, c in ctx.items():
            assert inner.contexts[rid] == c  # every update applied once, in order
            gen = c[start_len[rid]:]
            ref = list(c[:start_len[rid]])
            for tok in gen:  # lossless: each emitted token is the target's greedy choice
                assert tok == target.next_token(ref)
                ref.append(tok)
    finally:
        d.close()
    s = d.stats
    assert sys.getswitchinterval() == interval  # the workers' short GIL switch interval is restored
    assert s.lookups == s.hits + s.late_hits + s.misses
    assert s.hedges >= s.hits + s.late_hits
    assert s.sync_drafts + s.miss_no_draft == s.misses
    if d.config.on_miss == "sync":
        assert s.miss_no_draft == 0


@pytest.mark.parametrize("seed", SEEDS)
def test_random_episodes(seed: int) -> None:
    _episode(seed, time.perf_counter() + TIME_LIMIT_S / len(SEEDS))
