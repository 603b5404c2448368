"""benchmarks/bench_slot_forecast.py: the slot lag replay on recorded responses (CPU, synthetic traces)."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.eval.records import TraceRecord

pytest.importorskip("torch")


def _records(n: int = 6) -> list[TraceRecord]:
    """Responses that repeat a growing prefix of their prompt: copies the suffix drafter matches ever longer."""
    rng = np.random.default_rng(3)
    out = []
    for i in range(n):
        base = rng.integers(5, 400, size=40).tolist()
        response = (base[:10] + base[:20] + base[:40] + base) * 2
        out.append(TraceRecord(f"r{i}", np.array(base, np.int32), np.array(response, np.int32)))
    return out


def test_slot_growth_recovers_tokens_the_lag_cut_and_sync_bounds_it():
    from benchmarks.bench_slot_forecast import SYNC, run

    recs = _records()
    rows = {g: run(recs, batch_size=4, growth=g, k=16, steps=60, token_cost=0.0) for g in (SYNC, "0", "1")}
    for r in rows.values():
        assert r["verified_per_step"] >= r["emitted_per_step"] > 1.0  # every emitted token was verified
    assert rows["0"]["growth_extra_slots"] == 0 and rows[SYNC]["growth_extra_slots"] == 0
    assert rows["1"]["growth_extra_slots"] > 0 and 0 < rows["1"]["growth_extra_used"] <= rows["1"]["growth_extra_slots"]
    assert rows["0"]["emitted_per_step"] < rows["1"]["emitted_per_step"] <= rows[SYNC]["emitted_per_step"] * 1.02
    high = run(recs, batch_size=4, growth="1", k=16, steps=60, token_cost=0.99)  # the extra slots never pay
    assert high["growth_notes"] < rows["1"]["growth_notes"]


def test_slot_lag_replay_counts_truncated_and_filler_slots_and_the_cut_shortens_drafts():
    from benchmarks.bench_slot_forecast import SYNC, run

    recs = _records()
    sync = run(recs, batch_size=4, growth=SYNC, k=16, steps=60, token_cost=0.0)
    lag = run(recs, batch_size=4, growth="0", k=16, steps=60, token_cost=0.0)
    assert sync["truncated_per_step"] == 0 and sync["filler_per_step"] == 0  # every draft at its own length
    assert lag["truncated_per_step"] > 0  # growing copies outrun the older draft's length
    strict = run(recs, batch_size=4, growth=SYNC, k=16, steps=60, token_cost=0.999, cut=True)
    assert strict["cut"] and strict["verified_per_step"] < sync["verified_per_step"]  # the cut drops tokens
    assert strict["emitted_per_step"] >= 1.0
