"""The goodness-of-fit test of serve_features' sampling check: cells, statistic, p-values, power, the biased
sampler it must catch."""

from __future__ import annotations

import math
import random

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
