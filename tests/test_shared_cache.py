"""Shared-cache simulation (docs/shared-cache.md): routing by hand; N = 1 and a zero-delay shared cache: one cache."""

from __future__ import annotations

import numpy as np

from specdec.drafters import build_drafter
from specdec.eval.records import TraceRecord
from specdec.eval.replay import replay
from specdec.eval.shared_cache import Cell, add_gains, route, simulate, verdict


def _records(n: int = 14, seed: int = 2) -> list[TraceRecord]:
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, 40, size=int(rng.integers(3, 9))) for _ in range(5)]
    out = []
    for i in range(n):
        body = np.concatenate([phrases[int(j)] for j in rng.integers(0, 5, size=6)])
        out.append(TraceRecord(f"r{i}", body[:4], body[4:], group=f"g{i % 3}"))
    return out


def _plain():
    return build_drafter({"name": "suffix", "min_confidence": 0.0})


def _counts(cell: Cell) -> tuple[int, int, int, int]:
    return cell.steps, cell.drafted, cell.accepted, cell.emitted


def test_routes_by_hand():
    recs = _records()
    assert [route(i, r, 4, "round-robin") for i, r in enumerate(recs[:6])] == [0, 1, 2, 3, 0, 1]
    sticky = [route(i, r, 4, "sticky") for i, r in enumerate(recs)]
    assert all(sticky[i] == sticky[i % 3] for i in range(len(recs)))  # one replica per conversation g0, g1, g2


def test_one_replica_is_a_plain_replay_and_zero_delay_is_one_cache():
    recs = _records()
    res = replay(_plain(), recs, budget=16, tree=False)
    one = simulate(recs, _plain, n=1, routing="sticky", delay=None)
    assert _counts(one) == (res.steps, res.drafted_tokens, res.accepted_tokens, res.emitted_tokens)
    # every replica sees every earlier response before the next arrival: the same global trie as one replica's
    shared = simulate(recs, _plain, n=3, routing="round-robin", delay=0)
    assert _counts(shared) == _counts(one)


def test_own_caches_see_their_own_records_only():
    recs = _records()
    halves = [replay(_plain(), recs[k::2], budget=16, tree=False) for k in (0, 1)]
    own = simulate(recs, _plain, n=2, routing="round-robin", delay=None)
    assert own.steps == sum(h.steps for h in halves) and own.accepted == sum(h.accepted_tokens for h in halves)


def test_gains_and_verdict_by_hand():
    rows = [
        {"dataset": "d", "n": 4, "routing": "sticky", "cache": "own", "mat": 2.0, "insert_us_per_step": 0.0},
        {"dataset": "d", "n": 4, "routing": "sticky", "cache": "shared D=16", "mat": 2.2, "insert_us_per_step": 50.0},
    ]
    add_gains(rows, rtt_us=100.0)
    assert abs(rows[1]["gain"] - 0.1) < 1e-12
    assert abs(rows[1]["net_gain_sync"] - (1.1 * 5000 / 5100 - 1)) < 1e-12
    assert abs(rows[1]["net_gain_async"] - (1.1 * 5000 / 5050 - 1)) < 1e-12
    assert verdict(rows, 16)["build"] is True
