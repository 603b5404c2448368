"""The goodness-of-fit test of serve_features' sampling check: cells, statistic, p-values, power, the biased
sampler it must catch."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from benchmarks import serve_stats
from benchmarks.serve_stats import chi_square_p


def test_p_value_matches_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    for stat, dof in ((3.0, 1), (12.5, 6), (40.0, 20), (0.5, 3)):
        assert chi_square_p(stat, dof) == pytest.approx(stats.chi2.sf(stat, dof), rel=1e-9)


# --------------------------------------------------------------------------- goodness of fit (sampling check)
def test_pooled_cells_keeps_the_likely_and_pools_the_rest() -> None:
    probs = {"a": 0.6, "b": 0.2, "c": 0.1, "d": 0.05, "e": 0.001}  # 0.049 left out
    cells, cell_of = serve_stats.pooled_cells(1000, probs)
    assert set(cells) == {"a", "b", "c", serve_stats.OTHER}  # MAX_CELLS 4: three kept, one pooled
    assert cells[serve_stats.OTHER] == pytest.approx(0.05 + 0.001 + 0.049)
    assert serve_stats.where(cell_of, "e") == serve_stats.OTHER == serve_stats.where(cell_of, "never-seen")
    cells, cell_of = serve_stats.pooled_cells(200, {"a": 0.9, "b": 0.08})  # other expected 4 < 5: folded into b
    assert cells == pytest.approx({"a": 0.9, "b": 0.1}) and serve_stats.where(cell_of, "zz") == "b"


def test_chi_square_fit_by_hand() -> None:
    probs = {"x": 0.5, "y": 0.3}  # other 0.2
    samples = ["x"] * 60 + ["y"] * 20 + ["z"] * 20  # expected 50 / 30 / 20
    stat, dof, p = serve_stats.chi_square_fit([(samples, probs)])
    assert stat == pytest.approx(100 / 50 + 100 / 30) and dof == 2
    assert p == pytest.approx(math.exp(-stat / 2))  # chi-square(2)'s tail
    stat2, dof2, _ = serve_stats.chi_square_fit([(samples, probs), (samples, probs)])  # groups add
    assert stat2 == pytest.approx(2 * stat) and dof2 == 4


def test_shift_samples_moves_that_share_to_the_mode() -> None:
    samples = ["a"] * 50 + ["b"] * 30 + ["c"] * 20
    out = serve_stats.shift_samples(samples, share=0.03)
    assert out.count("a") == 53 and out.count("b") + out.count("c") == 47
    assert serve_stats.shifted({"a": 0.5, "b": 0.3}, share=0.1) == pytest.approx({"a": 0.6, "b": 0.24})


def test_fit_power_is_the_size_without_bias_and_matches_simulation() -> None:
    probs = {"a": 0.6, "b": 0.25, "c": 0.1}  # other 0.05
    assert serve_stats.fit_power([(5000, probs)], share=0.0, p_min=0.01) == pytest.approx(0.01, rel=1e-3)
    predicted = serve_stats.fit_power([(3000, probs)], share=0.03, p_min=0.01)
    rng = random.Random(1)
    moved = serve_stats.shifted(probs, share=0.03)
    cats, weights = [*moved, "z"], [*moved.values(), 1 - sum(moved.values())]
    trials = 200
    rejected = sum(
        serve_stats.chi_square_fit([(rng.choices(cats, weights, k=3000), probs)])[2] <= 0.01 for _ in range(trials)
    )
    assert 0.5 < predicted < 0.95  # a regime where the check means something
    assert abs(rejected / trials - predicted) < 0.1


def test_noncentral_tail_matches_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    for x, dof, lam in ((16.3, 3, 40.0), (5.0, 1, 0.5), (45.0, 20, 30.0)):
        assert serve_stats.noncentral_tail(x, dof, lam) == pytest.approx(stats.ncx2.sf(x, dof, lam), rel=1e-6)
    assert serve_stats.chi_square_quantile(0.999, 3) == pytest.approx(16.266, rel=1e-3)


# --------------------------------------------------------------------------- the sampling check's counting
def test_accepted_at_position_2_is_the_position_0_count() -> None:
    from benchmarks.serve_sampling import accepted_at

    assert accepted_at(2, samples=100, accepted={0: 61.0, 1: 40.0}, steps=100.0) == 61.0


def test_accepted_at_position_3_counts_what_token_3_drafts_are_sure_of() -> None:
    from benchmarks.serve_sampling import accepted_at

    # 100 samples of 3 tokens: 20 first steps accepted position 0 (one step each: 2 x 100 - 180 = 20), 12 of them
    # position 1 too (token 3 a draft); the other 80 took a second step, 50 of which accepted position 0 (token 3)
    # and 30 position 1 as well (past max_tokens): position 0 counts 70, position 1 counts 42; token 3 was a draft
    # in 62 samples, the bound is max(42, 50)
    assert accepted_at(3, samples=100, accepted={0: 70.0, 1: 42.0}, steps=180.0) == 50.0
    # most first steps drafted (schedule mode's lucky case): 60 one-step samples, 50 of them drafted token 3; 40
    # second steps, 10 accepted position 0, none position 1: the position-1 count is the bound
    assert accepted_at(3, samples=100, accepted={0: 70.0, 1: 50.0}, steps=140.0) == 50.0
    # no second step accepted anything: the first steps' position-0 acceptances are not counted at position 3
    assert accepted_at(3, samples=100, accepted={0: 20.0}, steps=180.0) == 0.0
    # never more than one per sample (a fake that counts an acceptance per step at every position)
    assert accepted_at(3, samples=100, accepted={0: 200.0, 1: 200.0}, steps=200.0) == 100.0
    with pytest.raises(ValueError, match="only 2 and 3"):
        accepted_at(4, samples=1, accepted={}, steps=0.0)


def test_sampling_prompts_by_position_and_groups_by_prefix(tmp_path: Path) -> None:
    from benchmarks.serve_sampling import by_prefix, load_sampling_prompts

    f = tmp_path / "p.json"
    f.write_text(json.dumps({"prompts": [{"ids": [1, 2]}, {"ids": [3], "position": 3}, {"ids": [4], "position": 2}]}))
    assert load_sampling_prompts(2, f) == [[1, 2], [4]]  # rows without a position were picked for position 2
    assert load_sampling_prompts(3, f) == [[3]]
    assert by_prefix([(5, 6, 7), (5, 6, 8), (5, 9, 7)]) == {(5, 6): ["7", "8"], (5, 9): ["7"]}


def test_long_prompt_follows_a_copy_cyclically() -> None:
    from benchmarks.long_prompt import following

    unit = [5, 6, 7, 8]
    assert following([7, 8, 5, 6, 9], unit, 2) == 4  # 7 8 | 5 6 continue the copy from offset 2, then 9 does not
    assert following([6, 7], unit, 2) == 0
    assert following([], unit, 0) == 0
