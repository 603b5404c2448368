"""The tree-prize benchmark's logic (static shapes from rank statistics) and the step-cost curve's rule."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.step_cost_curve import free_budgets, largest_free, prefill, summarize, verify_forward
from benchmarks.tree_prize_report import gains, prize_rows, ratio_ci
from benchmarks.tree_prize_shapes import (
    MAX_DEPTH,
    MAX_RANK,
    RankStats,
    ShapedDrafter,
    acceptance_table,
    pool_budget,
    prune_to_shape,
    rank_paths,
    static_shape,
)
from core_support import LlamaSpec, tiny_llama
from specdec.drafters.base import Drafter, DraftRequest
from specdec.tree import TokenTree

ROOT = -1
VERIFY_SPEC = LlamaSpec(vocab=97, hidden=32, max_pos=128)  # Llama's init and token ids, untied


def _tree() -> TokenTree:
    """Root children 10 (p .3) and 11 (p .6); 10 -> 12 (.9); 11 -> 13 (.2), 14 (.7); 14 -> 15 (1.0)."""
    return TokenTree(
        np.array([10, 11, 12, 13, 14, 15]), np.array([ROOT, ROOT, 0, 1, 1, 4]), np.array([0.3, 0.6, 0.9, 0.2, 0.7, 1.0])
    )


def test_rank_paths_rank_siblings_by_probability() -> None:
    assert rank_paths(_tree()) == [(1,), (0,), (1, 0), (0, 1), (0, 0), (0, 0, 0)]


def test_rank_paths_without_probs_rank_by_index() -> None:
    t = TokenTree(np.array([5, 6, 7]), np.array([ROOT, ROOT, 1]))
    assert rank_paths(t) == [(0,), (1,), (1, 0)]


def test_rank_stats_count_the_true_walk() -> None:
    stats = RankStats()
    stats.observe(_tree(), [11, 14, 15, 99])  # rank 0, rank 0, rank 0, then a miss at depth 4
    stats.observe(_tree(), [10, 12, 3])  # rank 1, rank 0, then a miss (node 12 has no children)
    stats.observe(_tree(), [42])  # miss at depth 1
    assert stats.reach[:5].tolist() == [3, 2, 2, 1, 0]
    assert stats.hits[0, :3].tolist() == [1, 1, 0]
    assert stats.hits[1, :2].tolist() == [2, 0]
    assert stats.hits[2, :2].tolist() == [1, 0]
    p = acceptance_table(stats)
    assert p.shape == (MAX_DEPTH, MAX_RANK)
    np.testing.assert_allclose(p[0, :3], [1 / 3, 1 / 3, 0.0])
    np.testing.assert_allclose(p[1, :2], [1.0, 0.0])
    np.testing.assert_allclose(p[3, :2], [0.0, 0.0])


def test_acceptance_table_is_non_increasing_in_rank() -> None:
    stats = RankStats()
    stats.hits[0, :3] = [2, 5, 1]
    stats.reach[0] = 10
    np.testing.assert_allclose(acceptance_table(stats)[0, :3], [0.2, 0.2, 0.1])


def test_static_shape_hand_checked() -> None:
    p = np.zeros((3, 3))  # powers of two: products are exact, so ties are real ties
    p[0] = [0.5, 0.25, 0.125]
    p[1] = [0.5, 0.125, 0.0]
    p[2] = [0.5, 0.25, 0.0]
    # values: (0) .5; (1) .25, (0,0) .25; (2) .125, (1,0) .125, (0,0,0) .125; (0,1) .0625, (0,0,1) .0625, ...
    assert static_shape(p, 1) == [(0,)]
    assert static_shape(p, 4) == [(0,), (1,), (0, 0), (2,)]  # ties: shallower first
    assert static_shape(p, 6) == [(0,), (1,), (0, 0), (2,), (1, 0), (0, 0, 0)]
    assert len(static_shape(p, 100)) == 3 + 6 + 12  # every path of value > 0 (ranks 0-1 below depth 1)


def _values(p: np.ndarray, paths: Sequence[tuple[int, ...]]) -> list[float]:
    return [float(np.prod([p[d, r] for d, r in enumerate(path)])) for path in paths]


@pytest.mark.parametrize("seed", range(5))
def test_static_shape_is_a_closed_tree_holding_the_top_values(seed: int) -> None:
    rng = np.random.default_rng(seed)
    depth, ranks, budget = 4, 3, 9
    p = -np.sort(-rng.uniform(0.05, 1.0, (depth, ranks)), axis=1)  # non-increasing in rank
    shape = static_shape(p, budget)
    assert len(shape) == budget and len(set(shape)) == budget
    for path in shape:  # closed under parent and elder sibling
        assert len(path) == 1 or path[:-1] in shape
        assert path[-1] == 0 or path[:-1] + (path[-1] - 1,) in shape
    every = [path for d in range(1, depth + 1) for path in itertools.product(range(ranks), repeat=d)]
    best = sorted(_values(p, every), reverse=True)[:budget]
    assert sum(_values(p, shape)) == pytest.approx(sum(best))


def test_prune_to_shape_keeps_the_shape_positions() -> None:
    t = prune_to_shape(_tree(), frozenset({(0,), (0, 0), (1,)}))
    assert t.tokens.tolist() == [10, 11, 14]  # (1,) = 10, (0,) = 11, (0, 0) = 14, in the tree's order
    assert t.parents.tolist() == [ROOT, ROOT, 1]
    np.testing.assert_allclose(t.probs, [0.3, 0.6, 0.7])


class _Fixed(Drafter):
    """Returns ``_tree()`` for tree requests, a chain of 3 for chain requests; records the asks."""

    name = "fixed"

    def __init__(self) -> None:
        self.asks: list[DraftRequest] = []

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None: ...

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None: ...

    def stop(self, request_id: str) -> None: ...

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        self.asks += list(requests)
        return [_tree() if r.tree else TokenTree.chain([1, 2, 3]) for r in requests]


def test_shaped_drafter_asks_the_pool_and_prunes_trees_only() -> None:
    inner = _Fixed()
    d = ShapedDrafter(inner, [(0,), (0, 0)])
    tree, chain = d.draft_batch([DraftRequest("a", 2, True), DraftRequest("b", 3, False)])
    assert [(a.budget, a.tree) for a in inner.asks] == [(pool_budget(2), True), (3, False)]
    assert tree.tokens.tolist() == [11, 14] and tree.parents.tolist() == [ROOT, 0]
    assert chain.tokens.tolist() == [1, 2, 3]
    assert pool_budget(2) == 8 and pool_budget(100) == 256


def test_decision_rule_counts_only_free_budgets_at_the_threshold() -> None:
    cells = [
        {"dataset": "d", "drafter": "x", "budget": b, "arm": arm, "mat": mat}
        for b, arm, mat in [
            (8, "chain", 2.0),
            (8, "tree-own", 2.15),
            (8, "tree-static", 2.17),
            (32, "chain", 2.0),
            (32, "tree-own", 2.4),
        ]
    ]
    rows = prize_rows(cells)
    assert rows[0]["tree-own / chain"] == pytest.approx(1.075) and rows[1]["tree-static"] is None
    assert gains(rows, [1, 2, 4, 8, 16]) == [
        {"dataset": "d", "drafter": "x", "budget": 8, "arm": "tree-static", "ratio": 1.085}
    ]
    assert [g["budget"] for g in gains(rows, [8, 32])] == [8, 32]
    assert gains(rows, [1, 2, 4]) == []


def test_ratio_ci_brackets_the_paired_ratio() -> None:
    chain, tree = [10, 20, 30, 40], [8, 20, 25, 40]  # tree / chain MAT = 100 / 93
    lo, hi = ratio_ci(chain, tree)
    assert lo <= 100 / 93 <= hi and lo >= 1.0  # the tree never takes more steps on any record
    assert ratio_ci([5, 5], [5, 5]) == (1.0, 1.0)
    with pytest.raises(ValueError, match="aligned"):
        ratio_ci([1, 2], [1])


# ----------------------------------------------------------------------------- step-cost curve
def test_free_budgets_hand_curve() -> None:
    curve = {0: 9.0, 1: 10.0, 2: 10.1, 4: 10.4, 8: 10.9, 16: 11.0, 32: 12.5, 64: 20.0}
    assert free_budgets(curve) == [1, 2, 4, 8, 16]  # 16: 11.0 <= 1.1 x 10.0 (k = 0 is not a budget)
    assert largest_free(curve) == 16
    assert free_budgets(curve, ratio=1.05) == [1, 2, 4]
    with pytest.raises(ValueError, match="k = 1"):
        free_budgets({0: 1.0, 2: 1.0})


def test_summarize_per_batch() -> None:
    rows = [
        {"batch": b, "k": k, "busy_ms": ms}
        for b, pts in {1: [(1, 4.0), (8, 4.2), (64, 6.0)], 8: [(1, 5.0), (8, 6.0), (64, 20.0)]}.items()
        for k, ms in pts
    ]
    s = summarize(rows)
    assert s["1"]["free_budgets"] == [1, 8] and s["8"]["free_budgets"] == [1]
    assert s["8"]["ratio_to_k1"]["64"] == 4.0


def test_verify_forward_matches_the_full_sequence_and_restores_the_cache() -> None:
    model, context, b, k = tiny_llama(0, spec=VERIFY_SPEC), 20, 2, 4
    cache = prefill(model, batch=b, context=context, device="cpu")
    assert cache.get_seq_length() == context
    ids = torch.randint(0, 97, (b, k + 1), generator=torch.Generator().manual_seed(3))  # [b, k + 1]
    fast = verify_forward(model, cache, ids, context)  # [b, k + 1, vocab]
    assert cache.get_seq_length() == context
    again = verify_forward(model, cache, ids, context)
    torch.testing.assert_close(fast, again)  # the second step sees the same cache
    prompt = torch.randint(0, 97, (b, context), generator=torch.Generator().manual_seed(0))  # prefill's tokens
    with torch.inference_mode():
        full = model(input_ids=torch.cat([prompt, ids], dim=1)).logits[:, context:]  # [b, k + 1, vocab]
    torch.testing.assert_close(fast, full, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_step_cost_curve_runs_on_gpu(tmp_path: Path) -> None:
    import json

    from benchmarks.step_cost_curve import main

    model_dir = tmp_path / "tiny"
    tiny_llama(0, spec=VERIFY_SPEC).save_pretrained(model_dir)
    assert (
        main(
            [
                "--model",
                str(model_dir),
                "--out-dir",
                str(tmp_path / "out"),
                "--ks",
                "0",
                "1",
                "4",
                "--repeats",
                "2",
                "--context",
                "32",
            ]
        )
        == 0
    )
    doc = json.loads((tmp_path / "out" / "step_cost_curve.json").read_text())
    assert {(r["batch"], r["k"]) for r in doc["rows"]} == {(b, k) for b in (1, 8) for k in (0, 1, 4)}
    assert all(r["busy_ms"] > 0 for r in doc["rows"]) and (tmp_path / "out" / "step_cost_curve.png").exists()
